"""How many micro-batches' stashes each chunk holds at once, read from the schedule's own order data
(`gpipe.orders.ScheduleOrder`): the loop that runs the schedule holds exactly what its order allows."""

from __future__ import annotations

from gpipe_tf.gpipe.orders import ScheduleOrder


def stashed_micro_batches(order: ScheduleOrder, num_micro_batches: int) -> list[int]:
    """Micro-batches each of the v*K chunks holds stashed at its peak (forward done, backward not).

    No in-flight bound (FillDrain, Unrolled: every forward before any backward): M on every chunk. A window w
    (1F1B: K - c; Interleaved: vK - c): min(M, w). With a weight window u (zero bubble), a chunk also keeps the
    stashes of up to u micro-batches whose input gradient ran and whose weight gradients wait: min(M, w + u).
    Batched weight gradients wait for the last backward: M (counted as whole stashes, an upper bound: what waits
    is the matmuls' inputs and output gradients).
    """
    m = num_micro_batches
    if order.in_flight is None or order.batched_weights:
        return [m] * order.num_chunks
    waiting = order.weight_window or (0,) * order.num_chunks
    return [min(m, w + u) for w, u in zip(order.in_flight, waiting)]
