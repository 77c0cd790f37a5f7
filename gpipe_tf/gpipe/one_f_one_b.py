"""One forward, one backward (PipeDream-Flush, "1F1B"): the loss inside the pipeline, a bounded number of
micro-batches in flight per stage, a graph constant in M.

GPipe's fill-drain runs every forward before any backward, so each stage keeps all M micro-batches' stashes
(inputs, and activations without rematerialization) until the drain. Here the last stage computes each
micro-batch's loss (`PipelineLoss`, handed over by the task) and its gradient right after its forward pass, so a
micro-batch's backward can start while later micro-batches still run forward, and stage k starts the forward of
micro-batch i only after its backward of micro-batch i - (K - k) is done: it holds at most K - k micro-batches'
stashes, whatever M. The bubble is fill-drain's, (K-1)/(M+K-1); the math is the same synchronous mini-batch step.

The order is data (`orders.one_f_one_b`: in-flight windows K - k); the loop that runs it is
`windowed_loop.run_training`. Outside training (evaluation, or a caller that runs the pipeline without a loss) the
schedule runs fill-drain's forward loop (`fill_drain.run_loop`), which needs no backward order.
"""

from __future__ import annotations

from gpipe_tf.gpipe import orders
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.windowed_loop import WindowedSchedule


class OneForwardOneBackward(WindowedSchedule, short_name="one_f_one_b"):
    """PipeDream-Flush's 1F1B order as one placed while loop: stage k holds at most K - k micro-batches. Knobs:
    the windowed loop's (`batch_weight_gradients`)."""

    def own_order(self, num_devices: int) -> ScheduleOrder:
        """1F1B: the loss per micro-batch, stage k holding at most K - k micro-batches (`orders.one_f_one_b`)."""
        return orders.one_f_one_b(num_devices)
