"""The measured timeline of one pipelined step: which (stage, micro-batch) forward and backward ran when, on each
worker, read from the TensorFlow profiler's traces of the workers (`workers.LocalWorkers(..., profiler=True)`).

How a trace becomes cells:

* Steps run with a pause between them while the workers are traced; the pauses split the merged events of all
  workers into steps, and the first step that starts and ends inside the trace window and parses is kept.
* An op belongs to a pipeline stage by its name scope (``gpipe<id>_stage<s>``, `placement.stage_scope`), to the
  backward pass where its name says it is a gradient (``gradient_tape/``, ``gradients/``, ``_grad/``,
  ``backward/``), else to the forward pass. Input and weight gradients carry the same names, so a zero-bubble
  step's measured backward cells hold both B and W (its prediction draws W right after B, as the worker runs
  them: `timeline.predict`).
* The loop schedules (fill_drain, one_f_one_b, interleaved) run the same ops once per micro-batch, in micro-batch
  order on every stage, backwards in the order's backward order (`ScheduleOrder.backward_micro_batch`: last to
  first for fill-drain): the n-th run of an op in a step belongs to the n-th micro-batch of that order.
  A cell spans its ops, less lone ops far ahead or behind the rest (`_span`).
* Sends and receives between devices are transfer cells ('T'). Left out: loop bookkeeping outside any stage, a
  stage's ops that run once per step outside the loop, and shape and copy ops (`_BOOKKEEPING`), which run
  whenever their inputs' shapes are known and would stretch a cell over time its stage spent on other work.

The unrolled schedule names every (stage, micro-batch) step's ops apart, so its micro-batches cannot be told by
counting; its ops run once each, which `cells_of_step` refuses.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Sequence

from bench import op_breakdown
from gpipe_tf.gpipe import timeline
from gpipe_tf.gpipe.orders import ScheduleOrder

_STAGE = re.compile(r"gpipe\d+_stage(\d+)")
_BACKWARD = ("gradient_tape/", "gradients/", "_grad/", "backward/")
# Shape and loop bookkeeping: a gradient's shape ops, e.g., run as soon as the forward pass gives the shapes, long
# before the gradient itself can start; they would stretch a cell over time its stage spent elsewhere.
_BOOKKEEPING = {"Shape", "ShapeN", "BroadcastGradientArgs", "Reshape", "Identity", "Const", "Fill", "ZerosLike",
                "OnesLike", "Size", "Rank", "StridedSlice", "Pack", "Unpack", "Cast", "NoOp", "Enter", "Exit", "Merge",
                "Switch", "NextIteration", "LoopCond", "Less", "AddV2_int", "Range", "ConcatV2", "Squeeze",
                "ExpandDims", "TensorListPushBack", "TensorListPopBack", "TensorListReserve", "TensorListLength",
                "TensorArrayV3", "TensorArrayWriteV3", "TensorArrayReadV3", "TensorListSetItem", "TensorListGetItem"}

Event = op_breakdown.Event


def split_steps(per_worker: Sequence[list[Event]], min_gap: float) -> list[tuple[float, float]]:
    """(start, end) of each complete step: runs of all workers' ops separated by idle gaps of >= `min_gap` s; the
    first and last run are dropped (the trace window may cut them)."""
    spans = sorted((e[0], e[1]) for events in per_worker for e in events)
    runs: list[list[float]] = []
    for start, end in spans:
        if runs and start - runs[-1][1] < min_gap:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    return [(a, b) for a, b in runs[1:-1]]


def cells_of_step(per_worker: Sequence[list[Event]], window: tuple[float, float], num_micro_batches: int,
                  order: ScheduleOrder) -> list[timeline.Cell]:
    """The cells of the step in `window` of a schedule running `order` (`Schedule.step_order(K)`); row = worker,
    lap = which of its device's chunks the cell's chunk is (`ScheduleOrder.lap`; see the module doc).

    Raises:
      ValueError: an op ran neither once nor M times in the step, or no stage op ran M times (not a loop
        schedule, or a cut or stalled step).
    """
    m, k = num_micro_batches, len(per_worker)
    if order.num_devices != k:
        raise ValueError(f"the {order.name} order runs on {order.num_devices} devices but {k} workers were traced: "
                         f"pass the order for K={k}")
    cells = []
    for row, events in enumerate(per_worker):
        runs: dict[tuple[int, str, str], list[tuple[float, float]]] = collections.defaultdict(list)
        for start, end, node, op_type in events:
            if not window[0] <= start <= window[1]:
                continue
            if op_breakdown.category(op_type) == "transfer":
                cells.append(timeline.Cell(row, None, timeline.TRANSFER, start, end))
                continue
            found = _STAGE.findall(node)
            if not found or op_type in _BOOKKEEPING:
                continue
            phase = timeline.BACKWARD if any(tag in node for tag in _BACKWARD) else timeline.FORWARD
            runs[(int(found[-1]), phase, node)].append((start, end))
        ops: dict[tuple[int, str, int], list[tuple[float, float]]] = collections.defaultdict(list)
        for (stage, phase, node), times in runs.items():
            if len(times) == 1 and m > 1:
                continue  # once per step, outside the loop (e.g. setting up a gradient sum): no micro-batch's
            if len(times) != m:
                raise ValueError(f"op {node!r} ran {len(times)} times in one step on worker {row}, expected "
                                 f"M={m}: not a loop schedule, or the step was cut")
            for n, (start, end) in enumerate(times):
                i = order.backward_micro_batch(n, m) if phase == timeline.BACKWARD else n
                ops[(stage, phase, i)].append((start, end))
        for (stage, phase, micro_batch), intervals in ops.items():
            start, end = _span(intervals)
            if order.device(stage) != row:
                raise ValueError(f"chunk {stage} ran on worker {row}; expected worker {order.device(stage)}")
            ops = tuple(sorted((a, b) for a, b in intervals if start <= a and b <= end))
            cells.append(timeline.Cell(row, micro_batch, phase, start, end, lap=order.lap(stage), ops=ops))
    if not any(c.phase != timeline.TRANSFER for c in cells):
        raise ValueError("no stage op ran M times in this step: a part of a stalled step, or not a pipeline")
    return cells


# Ops set apart from a cell's work: leading or trailing ops holding under LONE_SHARE of the cell's op time, separated
# from the rest by a gap longer than GAP_SHARE of it.
LONE_SHARE = 0.05
GAP_SHARE = 0.1


def _span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """The interval a cell's ops cover, without leading or trailing ops set apart from its work: an op that waits for
    nothing (e.g. broadcasting the loss gradient's seed, or reading a weight) runs as soon as its loop iteration
    starts, and would otherwise draw the cell from before its input arrived (`LONE_SHARE`, `GAP_SHARE`)."""
    ops = sorted(intervals)
    total = sum(end - start for start, end in ops)

    def cut(ops: list[tuple[float, float]]) -> list[tuple[float, float]]:
        held, reach = 0.0, ops[0][1]
        for i in range(len(ops) - 1):
            held += ops[i][1] - ops[i][0]
            reach = max(reach, ops[i][1])
            if held > LONE_SHARE * total:
                break
            if ops[i + 1][0] - reach > GAP_SHARE * total:
                return ops[i + 1:]
        return ops

    ops = cut(ops)
    ops = [(-end, -start) for start, end in cut(sorted((-end, -start) for start, end in ops))]
    return min(start for start, _ in ops), max(end for _, end in ops)


def trace_step(profiler_addresses: Sequence[str], run_step: Callable[[], object], step_seconds: float,
               num_micro_batches: int, order: ScheduleOrder, attempts: int = 3) -> timeline.Timeline:
    """Traces the workers while `run_step` runs steps with pauses, and returns one complete step's timeline.

    `step_seconds`: about how long a step takes; the pause between steps is twice that (at least 0.5 s) and the
    trace covers about five steps (at least 4 s). On a busy machine a step may stall inside, look like two, or
    fall off the trace: every step found is tried, and the whole trace is taken again up to `attempts` times.

    Raises:
      RuntimeError: no trace of `attempts` held a step whose ops ran once or M times each; names the last reason.
    """
    pause = max(0.5, 2.0 * step_seconds)
    duration = max(4.0, 5.0 * (step_seconds + pause))
    reason = "no trace taken"
    for _ in range(attempts):
        per_worker = _trace(profiler_addresses, run_step, pause, duration)
        steps = split_steps(per_worker, 0.5 * pause)
        if not steps:
            reason = f"no complete step in the {duration:.1f} s trace"
        for window in steps:
            try:
                cells = cells_of_step(per_worker, window, num_micro_batches, order)
            except ValueError as e:  # a stalled or cut step; the next one, or the next trace, may be whole
                reason = str(e)
                continue
            return timeline.Timeline.measured(order, num_micro_batches, cells)
        duration *= 2
    raise RuntimeError(f"no whole step in {attempts} traces of the workers ({reason}): the machine may be too busy; "
                       "run again on a quieter machine")


def _trace(profiler_addresses: Sequence[str], run_step: Callable[[], object], pause: float,
           duration: float) -> list[list[Event]]:
    """Each worker's events while `run_step` runs steps `pause` seconds apart, traced for `duration` seconds."""
    with op_breakdown.worker_traces(profiler_addresses, run_step, int(1000 * duration), pause) as paths:
        return [op_breakdown.read_events(path) for path in paths]


def to_json(measured: timeline.Timeline, schedule: str) -> dict:
    """`measured` as JSON-ready data: the schedule's name (as `bench.pipeline` names it), K, M, v and every cell with
    its op intervals, so that `from_json` can rebuild it and a later prediction can be set beside it."""
    return dict(schedule=schedule, k=measured.num_stages, m=measured.num_micro_batches,
                virtual_stages=measured.virtual_stages,
                cells=[dict(row=c.stage, lap=c.lap, micro_batch=c.micro_batch, phase=c.phase, start=c.start,
                            end=c.end, ops=[list(op) for op in c.ops]) for c in measured.cells])


def from_json(data: dict, order: ScheduleOrder) -> timeline.Timeline:
    """The measured timeline `to_json` wrote, for `order` (the schedule's `step_order(K)`).

    Raises:
      ValueError: the data lacks a field, or holds no op intervals (written before they were saved).
    """
    missing = [key for key in ("k", "m", "cells") if key not in data]
    if missing:
        raise ValueError(f"the saved timeline lacks {missing}: write it again with bench.pipeline --timeline")
    if order.num_devices != data["k"]:
        raise ValueError(f"the saved timeline ran on K={data['k']} workers but the {order.name} order given is for "
                         f"K={order.num_devices}: pass the order for K={data['k']}")
    # "chunk": the key of the lap in files written by earlier versions.
    cells = [timeline.Cell(c["row"], c["micro_batch"], c["phase"], c["start"], c["end"], c.get("lap", c.get("chunk")),
                           tuple((a, b) for a, b in c.get("ops", ()))) for c in data["cells"]]
    if not any(c.ops for c in cells):
        raise ValueError("the saved timeline has no op intervals (a file written before they were saved): its "
                         "costs would count overlapping cells twice; write it again with bench.pipeline --timeline")
    return timeline.Timeline.measured(order, data["m"], cells)


def predicted_from(measured: timeline.Timeline) -> timeline.Timeline:
    """The schedule's predicted timeline with the measured step's median forward and backward cost of each
    chunk, so that the two pictures differ only by what the prediction leaves out (transfers, executor
    overhead, waiting, ops of different micro-batches sharing a worker). A cell's cost is its compute (the union
    of its ops' intervals, `Cell.compute`), not its span: where a worker ran the next micro-batch's forward beside
    the current backward, both spans cover both cells' ops, and costs from spans would count that time twice."""
    import statistics

    k, v = measured.num_stages, measured.virtual_stages
    forward: dict[int, list[float]] = collections.defaultdict(list)
    backward: dict[int, list[float]] = collections.defaultdict(list)
    for cell in measured.cells:
        if cell.phase in (timeline.FORWARD, timeline.BACKWARD):
            chunk = measured.chunk(cell)
            (forward if cell.phase == timeline.FORWARD else backward)[chunk].append(cell.compute)
    costs = [max(statistics.median(forward[s]), 1e-9) for s in range(k * v)]
    backward_costs = [max(statistics.median(backward[s]), 1e-9) for s in range(k * v)]
    return timeline.predict(measured.order, measured.num_micro_batches, costs, backward_costs=backward_costs)
