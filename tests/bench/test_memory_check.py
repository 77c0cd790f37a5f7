"""bench.memory_check: several fresh processes of one configuration combine into each device's largest peaks."""

import pytest

from bench import memory_check


def _run(tensors, allocator):
    return {"tensors": tensors, "measured": allocator, "predicted": [5, 6], "plan": {"devices": []}}


def test_largest_over_runs_takes_each_devices_largest_peaks_and_keeps_every_run():
    runs = [_run([176, 215], [200, 219]), _run([208, 203], [224, 219]), _run([192, 208], [203, 220])]
    combined = memory_check.largest_over_runs(runs)
    assert combined["tensors"] == [208, 215] and combined["measured"] == [224, 220]
    assert combined["tensors_runs"] == [[176, 215], [208, 203], [192, 208]]
    assert combined["allocator_runs"] == [[200, 219], [224, 219], [203, 220]]
    assert combined["predicted"] == [5, 6]


def test_largest_over_runs_refuses_no_runs_and_runs_of_different_devices():
    with pytest.raises(ValueError, match="one or more"):
        memory_check.largest_over_runs([])
    with pytest.raises(ValueError, match="same number of devices"):
        memory_check.largest_over_runs([_run([1, 2], [1, 2]), _run([1], [1])])


def test_spread_finds_the_devices_no_one_prediction_can_be_within_the_bound_of():
    rows = [{"config": "a", "device": 0, "tensors_runs": [176, 208]},  # 1.18x: beyond 1.10 / 0.95
            {"config": "a", "device": 1, "tensors_runs": [192, 208]},  # 1.083x
            {"config": "b", "device": 0, "tensors_runs": [64, 64]}]
    moved = memory_check.spread(rows, "tensors_runs")
    assert moved["widest"] is rows[0] and moved["ratio"] == pytest.approx(208 / 176)
    assert moved["moved"] == [rows[0]]


def test_the_summary_names_the_devices_that_moved_beyond_the_bound_and_the_allocators_slack():
    mib = 2 ** 20

    def row(config, device, predicted, tensors_runs, allocator_runs):
        measured, allocator = max(tensors_runs), max(allocator_runs)
        return {"config": config, "device": device, "predicted": predicted, "measured": measured,
                "error": predicted / measured - 1, "allocator": allocator, "allocator_error": predicted / allocator - 1,
                "tensors_runs": tensors_runs, "allocator_runs": allocator_runs}

    rows = [row("a", 0, 227 * mib, [176 * mib, 224 * mib], [177 * mib, 235 * mib]),
            row("b", 1, 67 * mib, [64 * mib, 64 * mib], [64 * mib, 86 * mib])]
    lines = memory_check.summary(rows, processes=2)
    assert lines[0].endswith("0 of 2 devices outside [-5%, +10%]")
    assert lines[1].startswith("against the allocator peak: largest error -22.1% (b device 1); 1 of 2")
    assert lines[2].startswith("allocator / tensors: largest 1.344x (b device 1)")
    assert lines[3].startswith("tensors peaks over 2 processes: widest spread 1.273x (a device 0: 176.00-224.00 MiB)")
    assert lines[4] == "  a device 0: 176.00-224.00 MiB"
    assert lines[5].startswith("allocator peaks over 2 processes: widest spread 1.344x (b device 1")
    assert lines[6:] == ["  a device 0: 177.00-235.00 MiB", "  b device 1: 64.00-86.00 MiB"]
    assert len(memory_check.summary(rows, processes=1)) == 3
