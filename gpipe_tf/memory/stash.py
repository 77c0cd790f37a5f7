"""How many micro-batches' stashes each chunk holds at once, read from the schedule's own order data
(`gpipe.orders.ScheduleOrder`): the loop that runs the schedule holds exactly what its order allows, and a device
holds the most when the sum over its chunks is largest, which need not be when each chunk holds its own most."""

from __future__ import annotations

import functools

from gpipe_tf.gpipe import timeline
from gpipe_tf.gpipe.orders import FORWARD, ScheduleOrder


def stashed_micro_batches(order: ScheduleOrder, num_micro_batches: int) -> list[int]:
    """Micro-batches each of the v*K chunks holds stashed (forward done; backward, and for split orders the weight
    gradients, not) at its device's busiest moment.

    No in-flight bound (FillDrain, Unrolled: every forward before any backward), or weight gradients batched
    after the last backward: M on every chunk. Otherwise from one simulated step of the order
    (`timeline.predict`, equal costs, W right after its B as the windowed loop runs it): at the end of each
    forward on a device, the micro-batches each of its chunks holds; the moment its chunks hold the most in all
    gives each chunk's count. With one chunk per device that is the window, min(M, w) (1F1B and zero bubble:
    K - k; a zero-bubble loop runs W(c, i) as soon as B(c, i), so no stash waits for its weight gradients); a V's
    two chunks never hold their maxima together.
    """
    return list(_stashed(order, num_micro_batches))


@functools.lru_cache(maxsize=256)  # a capacity search or a suggestion plans the same order many times
def _stashed(order: ScheduleOrder, num_micro_batches: int) -> tuple[int, ...]:
    """`stashed_micro_batches`, cached by order and M."""
    m = num_micro_batches
    if order.in_flight is None or order.batched_weights:
        return (m,) * order.num_chunks
    step = timeline.predict(order, m)
    spans: dict[tuple[int, int], list[float]] = {}  # (chunk, micro-batch) -> [forward end, last backward end]
    for cell in step.cells:
        span = spans.setdefault((step.chunk(cell), cell.micro_batch), [0.0, 0.0])
        if cell.phase == FORWARD:
            span[0] = cell.end
        else:
            span[1] = max(span[1], cell.end)
    counts = [0] * order.num_chunks
    for device in range(order.num_devices):
        # A sweep over the device's stash lifetimes: at a shared instant a stash ends before another begins.
        events = sorted((at, begins, c) for c in range(order.num_chunks) if order.device(c) == device
                        for i in range(m) for at, begins in ((spans[(c, i)][0], 1), (spans[(c, i)][1], 0)))
        held: dict[int, int] = {}
        best: dict[int, int] = {}
        total = most = 0
        for _, begins, c in events:
            change = 1 if begins else -1
            held[c] = held.get(c, 0) + change
            total += change
            if total > most:
                best, most = dict(held), total
        for c, n in best.items():
            counts[c] = n
    return tuple(counts)
