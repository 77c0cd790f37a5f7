"""Pipeline schedules as timelines: predicted from a schedule's order data and stage costs, or measured.

`predict` simulates one step of a schedule's order (`orders.ScheduleOrder`, the same data the schedule's loop is
built from; its module doc says what stages, chunks and laps are): every device runs one cell (a forward 'F' or
backward 'B' of one micro-batch on one chunk, and for zero-bubble orders its weight gradients 'W' apart from B) at
a time, each cell as soon as its
dependencies in the order have ended and its device is free, the device taking the cell that became ready
first (a backward before a forward that became ready at the same instant), as a TensorFlow worker runs ops as
their inputs arrive. For fill-drain and 1F1B, equal stage costs give exactly GPipe's bubble (K-1)/(M+K-1),
whatever the backward/forward ratio; interleaving v chunks per device lowers the bound to (K-1)/(vM+K-1)
(reached at K=2). Zero-bubble orders go below GPipe's bound only where W waits for the bubbles, which
TensorFlow's worker does not do with W per micro-batch (`predict`'s `defer_weights` draws both). Unbalanced
stages or per-stage rematerialization do worse, and `predict` shows by how much before anything is run.

`Timeline.measured` builds the same structure from measured cells (seconds), transfers ('T') included, so a
profiled step can be drawn next to its prediction (`gpipe_tf.training.timeline_pictures` draws both).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from gpipe_tf.gpipe.orders import BACKWARD, FORWARD, WEIGHT, ScheduleOrder, fill_drain
from gpipe_tf.hyperparams import ParamsError

__all__ = ["Cell", "Timeline", "predict", "check_positive", "FORWARD", "BACKWARD", "WEIGHT", "TRANSFER", "PHASES"]

TRANSFER = "T"
PHASES = (FORWARD, BACKWARD, WEIGHT, TRANSFER)
COMPUTE = (FORWARD, BACKWARD, WEIGHT)
_SEQUENCES = (collections.abc.Sequence, np.ndarray)



@dataclasses.dataclass
class Cell:
    """One unit of work on row `stage` (a device): micro-batch `micro_batch` forward ('F'), backward ('B') or weight
    gradients ('W'), or a transfer ('T', measured timelines only; its micro-batch may be None).

    With several chunks per device (interleaved, V orders) `lap` says which of the device's chunks runs: the chunk
    is `Timeline.chunk(cell)` (`ScheduleOrder.chunk_at`). Otherwise lap is 0 and the chunk is the stage.

    `ops` (measured cells): the intervals the cell's ops ran in, inside [start, end]. A worker runs ops of
    different micro-batches as their inputs arrive (the next micro-batch's forward beside the current backward),
    so a cell's span may hold other cells' ops and idle time; its ops are its compute. Empty: the whole span.
    """

    stage: int
    micro_batch: int | None
    phase: str
    start: float
    end: float
    lap: int = 0
    ops: tuple[tuple[float, float], ...] = ()

    @property
    def duration(self) -> float:
        """end - start."""
        return self.end - self.start

    @property
    def busy_intervals(self) -> list[tuple[float, float]]:
        """The intervals the cell computes in: its ops', else its whole span."""
        return list(self.ops) if self.ops else [(self.start, self.end)]

    @property
    def compute(self) -> float:
        """The time the cell computes: the union of `busy_intervals` (its duration when it has no ops)."""
        return _union_length(self.busy_intervals)


@dataclasses.dataclass
class Timeline:
    """A predicted or measured schedule: every cell with its start and end, the makespan and the bubble fraction.

    `order` is the schedule's order it ran or simulates. Rows (`num_stages`, K) are its devices, whose
    v = `virtual_stages` laps make K * v chunks (one chunk per row unless interleaved or a V).
    `bubble_fraction` is the share of K * makespan in which a row computes neither a
    forward nor a backward; `idle_fraction` the share in which it does nothing at all, transfers counting as
    busy (the two differ only for measured timelines with 'T' cells). Measured timelines (`Timeline.measured`)
    are in seconds and start at 0; predicted ones are in the unit of the stage costs.
    """

    order: ScheduleOrder
    num_micro_batches: int
    cells: list[Cell]
    makespan: float
    bubble_fraction: float
    remat: tuple[bool, ...] | None = None  # per chunk: its backward recomputes its forward
    is_measured: bool = False
    idle_fraction: float | None = None

    @property
    def num_stages(self) -> int:
        """K, the rows: devices, one stage each."""
        return self.order.num_devices

    @property
    def virtual_stages(self) -> int:
        """v, chunks per device."""
        return self.order.virtual_stages

    @property
    def schedule(self) -> str:
        """The order's name."""
        return self.order.name

    @classmethod
    def measured(cls, order: ScheduleOrder, num_micro_batches: int, cells: Sequence[Cell]) -> Timeline:
        """A timeline of measured cells (times in seconds, any origin: shifted so that the earliest start is 0).

        Cells of one row may overlap (a profiler sees what really ran); the busy time of a row is the union of its
        cells' `busy_intervals` (their ops' intervals where given, else their spans). The bubble counts only
        forward and backward compute as busy, since a transfer is pipeline overhead that a schedule exists to
        hide; `idle_fraction` also counts 'T' cells as busy.
        makespan runs from the earliest start to the latest end, transfers included.

        Args:
          order: the order of the schedule that ran (`Schedule.step_order(K)`): K rows, v chunks each; it names
            the picture and sets the bound.
          num_micro_batches: M.
          cells: the measured cells; 'F' and 'B' need a micro-batch in [0, M), a 'T' cell may have None.

        Raises:
          ParamsError: an argument or a cell is out of range, or the cells span no time.
        """
        if not isinstance(order, ScheduleOrder):
            raise ParamsError(f"order={order!r} is invalid: pass the ScheduleOrder of the schedule that ran, e.g. "
                              "schedule.step_order(K) or orders.fill_drain(K)")
        k, v = order.num_devices, order.virtual_stages
        m = _check_count("num_micro_batches", num_micro_batches, "the number of micro-batches per batch")
        if isinstance(cells, (str, bytes)) or not isinstance(cells, _SEQUENCES) or len(cells) == 0:
            raise ParamsError(f"cells={cells!r} is invalid: give a non-empty list of timeline.Cell, one per "
                              "measured forward, backward or transfer")
        checked = [_check_measured_cell(j, c, k, m, v) for j, c in enumerate(cells)]
        origin = min(c.start for c in checked)
        makespan = max(c.end for c in checked) - origin
        if makespan <= 0:
            raise ParamsError(f"cells span {makespan!r} seconds: a measured timeline needs at least one cell with "
                              "end > start")
        shifted = sorted((dataclasses.replace(c, start=c.start - origin, end=c.end - origin,
                                              ops=tuple((a - origin, b - origin) for a, b in c.ops))
                          for c in checked), key=lambda c: (c.start, c.stage))

        def busy(phases: tuple[str, ...]) -> float:
            return sum(_union_length([interval for c in shifted if c.stage == row and c.phase in phases
                                      for interval in c.busy_intervals]) for row in range(k))

        return cls(order=order, num_micro_batches=m, cells=shifted, makespan=makespan,
                   bubble_fraction=1.0 - busy(COMPUTE) / (k * makespan), is_measured=True,
                   idle_fraction=1.0 - busy(PHASES) / (k * makespan))

    @property
    def num_chunks(self) -> int:
        """K * v: the chunks a micro-batch passes through (K unless interleaved or a V)."""
        return self.num_stages * self.virtual_stages

    def chunk(self, cell: Cell) -> int:
        """The chunk `cell` runs: lap `cell.lap` of device `cell.stage` (`ScheduleOrder.chunk_at`)."""
        return self.order.chunk_at(cell.stage, cell.lap)

    def schedule_label(self) -> str:
        """The schedule's name, with v where a device runs several chunks ("interleaved v=2")."""
        return self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")

    def ideal_bubble_fraction(self) -> float:
        """The order's bound (`ScheduleOrder.bubble_bound`): GPipe's (K-1)/(M+K-1), (K-1)/(vM+K-1) with v chunks
        per device."""
        return self.order.bubble_bound(self.num_micro_batches)

    def cell(self, stage: int, micro_batch: int, phase: str, lap: int = 0) -> Cell:
        """The cell of row `stage` running `micro_batch` in `phase` ('F' or 'B'), on `lap` when interleaved."""
        for c in self.cells:
            if c.stage == stage and c.micro_batch == micro_batch and c.phase == phase and c.lap == lap:
                return c
        raise KeyError(f"no cell stage={stage} micro_batch={micro_batch} phase={phase!r} lap={lap} in this "
                       "timeline")

    def stage_cells(self, stage: int) -> list[Cell]:
        """The cells of row `stage` in the order it runs them."""
        return sorted((c for c in self.cells if c.stage == stage), key=lambda c: c.start)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """The total length covered by `intervals` (which may overlap)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _check_count(name: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ParamsError(f"{name}={value!r} is invalid: it must be an int >= 1 ({what})")
    return int(value)


def check_positive(name: str, value: object, what: str) -> float:
    """`value` as a float when it is a finite number > 0, else a ParamsError naming `name`, the value and `what`."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value <= 0):
        raise ParamsError(f"{name}={value!r} is invalid: it must be a finite number > 0 ({what})")
    return float(value)


def _check_measured_cell(j: int, cell: object, k: int, m: int, v: int) -> Cell:
    if not isinstance(cell, Cell):
        raise ParamsError(f"cells[{j}]={cell!r} is invalid: it must be a timeline.Cell")

    def bad(field: str, allowed: str) -> ParamsError:
        return ParamsError(f"cells[{j}].{field}={getattr(cell, field)!r} is invalid: it must be {allowed} "
                           f"(cell {cell!r})")

    def is_int(x: object) -> bool:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)

    if not is_int(cell.stage) or not 0 <= cell.stage < k:
        raise bad("stage", f"an int in [0, {k}) (num_stages={k})")
    if cell.phase not in PHASES:
        raise bad("phase", "'F' (forward), 'B' (backward), 'W' (weight gradients) or 'T' (transfer)")
    if cell.micro_batch is None and cell.phase != TRANSFER or (
            cell.micro_batch is not None and (not is_int(cell.micro_batch) or not 0 <= cell.micro_batch < m)):
        raise bad("micro_batch", f"an int in [0, {m}) (num_micro_batches={m})"
                  + (", or None for a transfer" if cell.phase == TRANSFER else ""))
    if not is_int(cell.lap) or not 0 <= cell.lap < v:
        raise bad("lap", f"an int in [0, {v}) (virtual_stages={v})")
    for field in ("start", "end"):
        value = getattr(cell, field)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise bad(field, "a finite number of seconds")
    if cell.end < cell.start:
        raise bad("end", f"a time >= start={cell.start!r}")
    ops = cell.ops if isinstance(cell.ops, _SEQUENCES) and not isinstance(cell.ops, (str, bytes)) else None
    if ops is None or not all(isinstance(op, _SEQUENCES) and len(op) == 2 and all(
            isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t) for t in op)
            and cell.start <= op[0] <= op[1] <= cell.end for op in ops):
        raise bad("ops", f"a list of (start, end) op intervals inside the cell's [{cell.start!r}, {cell.end!r}]")
    return dataclasses.replace(cell, stage=int(cell.stage), start=float(cell.start), end=float(cell.end),
                               lap=int(cell.lap), ops=tuple((float(a), float(b)) for a, b in ops),
                               micro_batch=None if cell.micro_batch is None else int(cell.micro_batch))


def _check_costs(stage_costs: Sequence[float] | None, count: int, count_text: str, name: str = "stage_costs",
                 what: str = "forward") -> list[float]:
    if stage_costs is None:
        return [1.0] * count
    if isinstance(stage_costs, (str, bytes)) or not isinstance(stage_costs, _SEQUENCES):
        raise ParamsError(f"{name}={stage_costs!r} is invalid: give a list of {count} {what} costs, "
                          "one per chunk (or None for equal chunks)")
    if len(stage_costs) != count:
        raise ParamsError(f"{name}={list(stage_costs)!r} has {len(stage_costs)} entries for {count_text}: "
                          f"give exactly one {what} cost per chunk")
    return [check_positive(f"{name}[{k}]", c, f"a chunk's {what} cost, e.g. its measured seconds")
            for k, c in enumerate(stage_costs)]


def _check_remat(remat: Sequence[bool] | bool, count: int, count_text: str) -> list[bool]:
    if isinstance(remat, (bool, np.bool_)):
        return [bool(remat)] * count
    if isinstance(remat, (str, bytes)) or not isinstance(remat, _SEQUENCES):
        raise ParamsError(f"remat={remat!r} is invalid: give True/False for all chunks or a list of "
                          f"{count} bools, one per chunk")
    if len(remat) != count:
        raise ParamsError(f"remat={list(remat)!r} has {len(remat)} entries for {count_text}: "
                          "give exactly one bool per chunk")
    for k, r in enumerate(remat):
        if not isinstance(r, (bool, np.bool_)):
            raise ParamsError(f"remat[{k}]={r!r} is invalid: it must be True or False")
    return [bool(r) for r in remat]

def _simulate(order: ScheduleOrder, m: int, costs: dict[str, list[float]], defer_weights: bool) -> list[Cell]:
    """Every cell of `order` at its start: when its dependencies have ended and its device is free, the device
    taking the cell that became ready first. Ties: a backward before a forward, the lower micro-batch and chunk.

    Weight gradients per micro-batch (`ScheduleOrder.weight_window`) run as `predict` says: with
    `defer_weights`, W is off the critical path and a device takes F and B before W when both can start at once;
    without, W(c, i) runs right after B(c, i) and what waits for B(c, i) waits for W(c, i) too.

    Committing the cell that can start earliest is final: any cell not yet ready waits for a cell that starts
    no earlier, so nothing committed later could have started before it on the same device.
    """
    k, chunks = order.num_devices, order.num_chunks
    keys = [(phase, s, i) for s in range(chunks) for i in range(m) for phase in order.phases]
    deps = {key: order.dependencies(*key, m) for key in keys}
    with_backward = order.weight_window is not None and not defer_weights
    if with_backward:  # B and W as one backward: its end is W's
        deps = {key: [(WEIGHT, s, i) if phase == BACKWARD and key[0] != WEIGHT else (phase, s, i)
                      for phase, s, i in needs] for key, needs in deps.items()}
    dependents: dict[tuple, list[tuple]] = {key: [] for key in keys}
    for key, needs in deps.items():
        for need in needs:
            dependents[need].append(key)
    missing = {key: len(needs) for key, needs in deps.items()}
    ready = {key: 0.0 for key in keys if not missing[key]}
    free, ends, cells = [0.0] * k, {}, []

    def priority(key: tuple) -> tuple:
        phase, s, i = key
        late = phase == WEIGHT and not with_backward
        return max(free[order.device(s)], ready[key]), late, phase != WEIGHT, ready[key], phase != BACKWARD, i, s

    while ready:
        key = min(ready, key=priority)
        phase, s, i = key
        d = order.device(s)
        start = max(free[d], ready.pop(key))
        ends[key] = free[d] = start + costs[phase][s]
        cells.append(Cell(d, i, phase, start, ends[key], order.lap(s)))
        for waiting in dependents[key]:
            missing[waiting] -= 1
            if not missing[waiting]:
                ready[waiting] = max(ends[need] for need in deps[waiting])
    if len(cells) != len(keys):  # an order whose rings wait on each other in a circle must not pass silently
        stuck = sorted(key for key in keys if key not in ends)[:4]
        raise ParamsError(f"the {order.name} order deadlocks: cells such as {stuck} wait on each other; fix its "
                          "in_flight windows, forward_waits or backward_waits")
    return cells


def predict(order: ScheduleOrder | int, num_micro_batches: int, stage_costs: Sequence[float] | None = None,
            backward_ratio: float = 2.0, remat: Sequence[bool] | bool = False, *,
            backward_costs: Sequence[float] | None = None, weight_fraction: float = 0.5,
            defer_weights: bool = False) -> Timeline:
    """Simulates one step of a schedule's order and returns its timeline (see the module doc).

    F(c, i) costs stage_costs[c] (default 1.0 each); B(c, i) costs backward_ratio * stage_costs[c], plus
    stage_costs[c] again where chunk c is rematerialized (its forward is recomputed inside the backward), or
    backward_costs[c] when given (e.g. measured). Where the order splits each backward into B and W
    (`ScheduleOrder.weight_window`), W(c, i) costs weight_fraction of the backward without its recomputation and
    B(c, i) the rest.

    How W per micro-batch runs (`defer_weights`): the windowed loop computes a chunk's B and W of one
    micro-batch in one gradient, whose ops TensorFlow's worker runs as their inputs arrive: W's weight-gradient
    matmuls become ready layer by layer beside B's, and the input gradient the previous chunk waits for is the
    last op. So by default W(c, i) runs right after B(c, i), and what waits for B(c, i) waits for W(c, i) too: a
    zero-bubble order's bubble is then its windows' (1F1B's for ZB-H1). `defer_weights=True` draws what a
    scheduler that holds W back would run (Qi et al.'s schedules: F and B before W, W in the bubbles), the bound
    the order data allows. Batched W (`ScheduleOrder.batched_weights`) runs after each chunk's last B either way.

    Args:
      order: the schedule's order (`Schedule.step_order(K)`, or `orders.fill_drain(K)` etc.); an int K stands
        for GPipe's fill-drain order on K stages.
      num_micro_batches: M (a multiple of `order.micro_batch_multiple`).
      stage_costs: forward cost of each chunk (any time unit; K * v of them, in pipeline order; with v = 1 each
        stage's), or None for equal chunks.
      backward_ratio: backward cost / forward cost of a chunk.
      remat: whether each chunk recomputes its forward in the backward; one bool applies to all.
      backward_costs: each chunk's backward cost, instead of backward_ratio and remat.
      weight_fraction: the share of a backward that its weight gradients take, in (0, 1); read only by orders
        with separate W cells.
      defer_weights: W per micro-batch runs where the order allows it, off the critical path, instead of right
        after its B as TensorFlow runs it (see above).

    Raises:
      ParamsError: an argument is out of range or has the wrong length.
    """
    if not isinstance(order, ScheduleOrder):
        order = fill_drain(_check_count("num_stages", order, "the number of pipeline stages"))
    m = _check_count("num_micro_batches", num_micro_batches, "the number of micro-batches per batch")
    order.check_micro_batches(m)
    phase_costs, recompute, work = _phase_costs(order, stage_costs, backward_ratio, remat, backward_costs,
                                                weight_fraction)
    if not isinstance(defer_weights, (bool, np.bool_)):
        raise ParamsError(f"defer_weights={defer_weights!r} is invalid: it must be True (W where the order allows "
                          "it) or False (W right after its B, as TensorFlow runs it)")
    cells = _simulate(order, m, phase_costs, bool(defer_weights))
    cells.sort(key=lambda c: (c.start, c.stage))
    makespan = max(c.end for c in cells)
    bubble = 1.0 - m * work / (order.num_devices * makespan)
    return Timeline(order=order, num_micro_batches=m, cells=cells, makespan=makespan, bubble_fraction=bubble,
                    remat=tuple(recompute), idle_fraction=bubble)


def _phase_costs(order: ScheduleOrder, stage_costs: Sequence[float] | None, backward_ratio: float,
                 remat: Sequence[bool] | bool, backward_costs: Sequence[float] | None,
                 weight_fraction: float) -> tuple[dict[str, list[float]], list[bool], float]:
    """({phase: each chunk's cost of one cell}, each chunk's remat, the work of one micro-batch through every
    chunk), checked; see `predict`'s Args."""
    k, v, count = order.num_devices, order.virtual_stages, order.num_chunks
    count_text = f"num_stages={k}" + (f" x virtual_stages={v} = {count} chunks" if v > 1 else "")
    costs = _check_costs(stage_costs, count, count_text)
    ratio = check_positive("backward_ratio", backward_ratio, "backward cost / forward cost, typically 2")
    recompute = _check_remat(remat, count, count_text)
    backward_cost = [ratio * c + (c if r else 0.0) for c, r in zip(costs, recompute)]
    if backward_costs is not None:
        backward_cost = _check_costs(backward_costs, count, count_text, "backward_costs", "backward")
    share = check_positive("weight_fraction", weight_fraction, "the weight gradients' share of a backward, < 1")
    if share >= 1:
        raise ParamsError(f"weight_fraction={weight_fraction!r} is invalid: it must be in (0, 1) (the weight "
                          "gradients' share of a backward, e.g. 0.5)")
    work = sum(costs) + sum(backward_cost)
    if WEIGHT not in order.phases:
        return {FORWARD: costs, BACKWARD: backward_cost}, recompute, work
    weight = [share * (b - (c if r and backward_costs is None else 0.0))
              for b, c, r in zip(backward_cost, costs, recompute)]
    return {FORWARD: costs, BACKWARD: [b - w for b, w in zip(backward_cost, weight)], WEIGHT: weight}, recompute, work
