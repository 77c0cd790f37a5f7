"""Measured timelines: trace events become (stage, micro-batch) cells, and `bench.pipeline --timeline` writes the
measured picture beside the predicted one with every forward and backward exactly once."""

import argparse
import collections
import json
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from bench import measured_timeline
from bench import pipeline as bench_pipeline
from gpipe_tf.gpipe import timeline
from gpipe_tf.gpipe.schedules import schedule_params
from tests.helpers.paths import ROOT


def _order(name, k):
    """The order data of the schedule a short name stands for, with its default knobs, on K devices."""
    return schedule_params(name).instantiate().step_order(k)


def _events(plan):
    """Events of one worker from (name, op type, duration) in run order, back to back from t=10 s."""
    events, t = [], 10.0
    for name, op_type, duration in plan:
        events.append((t, t + duration, name, op_type))
        t += duration
    return events


def test_cells_count_runs_of_each_op_in_micro_batch_order():
    m = 3
    fwd = "while/body/_1/while/gpipe0_stage0/forward/MatMul"
    bwd = "while/body/_1/gradient_tape/while/gpipe0_stage0/forward/MatMul/MatMul"
    plan = [("gradient_tape/while/gpipe0_stage0/sum/accumulator", "AddV2", 0.001)]  # once per step: skipped
    for _ in range(m):
        plan += [(fwd, "_MklMatMul", 0.01), (bwd + "/Shape", "Shape", 0.001)]  # shape ops run early: ignored
    for _ in range(m):
        plan += [(bwd, "_MklMatMul", 0.02), ("while/body/_1/Relu/_7", "_Send", 0.001)]
    events = _events(plan)
    for order, backward_order in (("one_f_one_b", [0, 1, 2]), ("fill_drain", [2, 1, 0])):
        cells = measured_timeline.cells_of_step([events], (0.0, 100.0), m, _order(order, 1))
        forward = sorted((c for c in cells if c.phase == timeline.FORWARD), key=lambda c: c.start)
        backward = sorted((c for c in cells if c.phase == timeline.BACKWARD), key=lambda c: c.start)
        assert [c.micro_batch for c in forward] == [0, 1, 2]
        assert [c.micro_batch for c in backward] == backward_order
        assert all(c.duration == pytest.approx(0.01) for c in forward)  # the Shape ops did not stretch them
        assert sum(c.phase == timeline.TRANSFER for c in cells) == m


def test_interleaved_laps_come_from_the_chunk():
    plan = []
    for chunk in (1, 3):  # device 1 of K=2 runs chunks 1 and 3: laps 0 and 1
        plan += [(f"while/gpipe4_stage{chunk}/forward/MatMul", "MatMul", 0.01)] * 2
        plan += [(f"while/gradient_tape/while/gpipe4_stage{chunk}/forward/MatMul/MatMul", "MatMul", 0.01)] * 2
    cells = measured_timeline.cells_of_step([[], _events(plan)], (0.0, 100.0), 2, _order("interleaved", 2))
    assert sorted((c.stage, c.lap, c.micro_batch, c.phase) for c in cells) == sorted(
        (1, lap, i, phase) for lap in (0, 1) for i in (0, 1) for phase in "FB")


def test_an_op_run_neither_once_nor_m_times_is_an_error():
    events = _events([("while/gpipe0_stage0/forward/MatMul", "MatMul", 0.01)] * 2)
    with pytest.raises(ValueError, match="ran 2 times in one step on worker 0, expected M=3"):
        measured_timeline.cells_of_step([events], (0.0, 100.0), 3, _order("one_f_one_b", 1))
    # The unrolled schedule names each micro-batch's ops apart: every op runs once, none M times.
    unrolled = _events([(f"gpipe0_stage0/micro_{i}/MatMul", "MatMul", 0.01) for i in range(2)])
    with pytest.raises(ValueError, match="no stage op ran M times"):
        measured_timeline.cells_of_step([unrolled], (0.0, 100.0), 2, _order("unrolled", 1))
    with pytest.raises(ValueError, match="the fill_drain order runs on 2 devices but 1 workers were traced"):
        measured_timeline.cells_of_step([events], (0.0, 100.0), 2, _order("fill_drain", 2))


def test_steps_are_split_at_pauses_and_cut_steps_dropped():
    worker0 = [(0.0, 0.1, "a", "MatMul"), (1.0, 1.2, "a", "MatMul"), (2.0, 2.1, "a", "MatMul")]
    worker1 = [(0.15, 0.3, "b", "MatMul"), (1.25, 1.4, "b", "MatMul"), (2.15, 2.2, "b", "MatMul")]
    assert measured_timeline.split_steps([worker0, worker1], 0.5) == [(1.0, 1.4)]


@pytest.mark.exhaustive(covered_by=(
    "tests/bench/test_measured_timeline.py::test_cells_count_runs_of_each_op_in_micro_batch_order",
    "tests/bench/test_measured_timeline.py::test_saved_timelines_round_trip_and_old_files_are_refused",
))
def test_bench_timeline_writes_measured_beside_predicted(tmp_path):
    """The real thing on two worker processes and a small MLP: a timing-free check of what the files hold."""
    out = tmp_path / "timelines"
    run = subprocess.run([sys.executable, "-m", "bench.pipeline", "--timeline", "--workload", "tiny", "--out",
                          str(out), "--micro-batches", "4", "--traced-steps", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "measured bubble" in line]
    assert len(lines) == 5 and all("predicted" in line and "bound" in line and "points apart" in line
                                   and " M=4: " in line for line in lines), run.stdout
    for schedule, v in (("fill_drain", 1), ("one_f_one_b", 1), ("interleaved", 2), ("zero_bubble", 1),
                        ("zero_bubble_v", 2)):
        order = _order(schedule, 2)
        cells = json.loads((out / f"timeline_{schedule}_m4.json").read_text())["cells"]
        counted = collections.Counter((order.chunk_at(c["row"], c["lap"]), c["micro_batch"], c["phase"])
                                      for c in cells if c["phase"] != "T")
        expected = {(s, i, phase) for s in range(2 * v) for i in range(4) for phase in "FB"}
        assert set(counted) == expected and set(counted.values()) == {1}, counted
        for c in cells:  # each cell's op intervals, so that a saved run's prediction can be recomputed
            assert all(c["start"] <= a <= b <= c["end"] for a, b in c["ops"]), c
        assert all(c["ops"] for c in cells if c["phase"] != "T")
        text = (out / f"timeline_{schedule}_m4.txt").read_text()
        assert text.startswith("predicted: ") and "\n\nmeasured: " in text
        measured_rows = [row for row in text.split("\n\nmeasured: ")[1].splitlines()[1:] if "|" in row]
        assert len(measured_rows) == 2
        for row in measured_rows:
            cells_text = row.split("|")[1]
            for i in range(4):  # every micro-batch's forward and backward shows on every row
                assert f"{i} " in cells_text or f"{i}a" in cells_text, (schedule, row)
                assert f"{i}'" in cells_text or f"{i}a'" in cells_text or f"{i}b'" in cells_text, (schedule, row)
        image = tf.io.decode_png((out / f"timeline_{schedule}_m4.png").read_bytes())
        assert image.shape[0] > 150 and image.shape[1] > 600
    # The saved cells give the same measured and predicted bubbles again, with no profiling.
    again = subprocess.run([sys.executable, "-m", "bench.pipeline", "--repredict", str(out), "--workload", "tiny"],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    repeated = [line for line in again.stdout.splitlines() if "measured bubble" in line]

    def bubbles(line):
        return re.search(r"measured bubble (\S+) .* vs predicted (\S+):", line).groups()

    assert [bubbles(line) for line in repeated] == [bubbles(line) for line in lines], (repeated, lines)
    assert all("(saved step; idle incl. transfers" in line for line in repeated)


def test_a_stalled_step_is_skipped_for_a_whole_one(monkeypatch):
    """On a busy machine a step can stall inside (and look like two): trace_step tries the next step."""
    op = "while/gpipe0_stage0/forward/MatMul"
    stalled = [(1.0, 1.1, op, "MatMul"), (2.0, 2.1, op, "MatMul")]  # split by a stall: each part runs it once
    whole = [(3.0, 3.1, op, "MatMul"), (3.1, 3.2, op, "MatMul")]
    events = [(0.0, 0.1, op, "MatMul")] + stalled + whole + [(5.0, 5.1, op, "MatMul")]
    monkeypatch.setattr(measured_timeline, "_trace", lambda *args: [events])
    got = measured_timeline.trace_step(["127.0.0.1:1"], lambda: None, 0.1, 2, _order("one_f_one_b", 1))
    assert sorted(c.micro_batch for c in got.cells) == [0, 1]
    assert got.makespan == pytest.approx(0.2)
    monkeypatch.setattr(measured_timeline, "_trace", lambda *args: [[(0.0, 0.1, op, "MatMul")]])
    with pytest.raises(RuntimeError, match=r"no whole step in 3 traces .*no complete step"):
        measured_timeline.trace_step(["127.0.0.1:1"], lambda: None, 0.1, 2, _order("one_f_one_b", 1))


def test_interleaved_ops_count_as_each_cells_compute_not_its_span():
    # One worker, M=2, 1F1B: the forward of micro-batch 1 runs beside the backward of micro-batch 0, their ops
    # alternating. Each span covers both cells' ops; the bubble and the prediction's costs count each cell's ops.
    fwd = "while/gpipe0_stage0/forward/MatMul"
    fwd2 = "while/gpipe0_stage0/forward/Relu"
    bwd = "while/gradient_tape/while/gpipe0_stage0/forward/MatMul/MatMul"
    bwd2 = "while/gradient_tape/while/gpipe0_stage0/forward/Relu/ReluGrad"
    plan = [(fwd, "MatMul", 0.01), (fwd2, "Relu", 0.01),  # F0: 10.00 .. 10.02
            (bwd, "MatMul", 0.02), (fwd, "MatMul", 0.01),  # B0 and F1 interleaved
            (bwd2, "ReluGrad", 0.02), (fwd2, "Relu", 0.01),
            (bwd, "MatMul", 0.02), (bwd2, "ReluGrad", 0.02)]  # B1
    cells = measured_timeline.cells_of_step([_events(plan)], (0.0, 100.0), 2, _order("one_f_one_b", 1))
    by_key = {(c.phase, c.micro_batch): c for c in cells}
    assert by_key["B", 0].duration == pytest.approx(0.05) and by_key["B", 0].compute == pytest.approx(0.04)
    assert by_key["F", 1].duration == pytest.approx(0.04) and by_key["F", 1].compute == pytest.approx(0.02)
    measured = timeline.Timeline.measured(_order("one_f_one_b", 1), 2, cells)
    assert measured.bubble_fraction == pytest.approx(0.0, abs=1e-9)  # the worker never idled
    predicted = measured_timeline.predicted_from(measured)
    # Costs from the ops: F 0.02, B 0.04 each; one device runs them back to back, 0.12 in all (medians of the
    # spans, F 0.03 and B 0.045, would give 0.15).
    assert predicted.makespan == pytest.approx(0.12)
    assert predicted.bubble_fraction == pytest.approx(0.0, abs=1e-9)


def test_timeline_schedules_flag_names_the_allowed_values():
    assert bench_pipeline._timeline_schedules("zero_bubble, zero_bubble_v") == ["zero_bubble", "zero_bubble_v"]
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(
            "--schedules='zero_bubbel' is invalid: give one or more of fill_drain,one_f_one_b,interleaved,"
            "zero_bubble,zero_bubble_v, comma-separated")):
        bench_pipeline._timeline_schedules("zero_bubbel")


def test_saved_timelines_round_trip_and_old_files_are_refused(tmp_path):
    order = _order("one_f_one_b", 2)
    cells = [timeline.Cell(0, 0, "F", 0.0, 1.0, ops=((0.0, 0.5), (0.6, 1.0))), timeline.Cell(1, 0, "F", 1.0, 2.0),
             timeline.Cell(1, 0, "B", 2.0, 4.0, ops=((2.0, 4.0),)), timeline.Cell(0, 0, "B", 4.0, 6.0),
             timeline.Cell(0, None, "T", 1.0, 1.1)]
    measured = timeline.Timeline.measured(order, 1, cells)
    data = json.loads(json.dumps(measured_timeline.to_json(measured, "one_f_one_b")))
    back = measured_timeline.from_json(data, order)
    assert back.cells == measured.cells and back.bubble_fraction == measured.bubble_fraction
    with pytest.raises(ValueError, match="the saved timeline ran on K=2 workers but the one_f_one_b order given is "
                                         "for K=3: pass the order for K=2"):
        measured_timeline.from_json(data, _order("one_f_one_b", 3))
    for c in data["cells"]:
        del c["ops"]
    with pytest.raises(ValueError, match="the saved timeline has no op intervals"):
        measured_timeline.from_json(data, order)
    with pytest.raises(FileNotFoundError, match="holds no timeline_\\*.json: give the --out directory"):
        bench_pipeline.repredict(str(tmp_path), "tiny")
    (tmp_path / "timeline_mine_m4.json").write_text(json.dumps(dict(data, schedule="mine")))
    with pytest.raises(ValueError, match="holds schedule='mine': --repredict reads the files of --timeline, whose "
                                         "schedules are fill_drain, one_f_one_b"):
        bench_pipeline.repredict(str(tmp_path), "tiny")


def test_a_cell_is_drawn_from_its_work_not_from_ops_that_ran_before_its_input():
    # Stage 1's forward of micro-batch 0 in a fill-drain step on this machine: two ops that wait for nothing ran at
    # 1.7 ms, its work from 71.9 ms (after stage 0's forward of it, 70 ms). Its span starts at its work.
    work = [(0.0719 + 0.001 * j, 0.0719 + 0.001 * j + 0.0009) for j in range(70)]
    start, end = measured_timeline._span([(0.0017, 0.00171), (0.00171, 0.00172)] + work)
    assert (start, end) == pytest.approx((0.0719, work[-1][1]))
    # Trailing ops apart from the work are cut the same way; ops that are a real share of the work are kept.
    assert measured_timeline._span(work + [(0.5, 0.50001)]) == pytest.approx((0.0719, work[-1][1]))
    assert measured_timeline._span([(0.0, 0.01)] + work)[0] == 0.0
