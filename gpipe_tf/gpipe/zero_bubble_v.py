"""Zero bubble V (ZB-V; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; torch.distributed.pipelining's
ScheduleZBVZeroBubble): ZB-H1's split of each backward into B (input gradient) and W (weight gradients) over two
chunks of layers per device placed in a V.

The model is cut into 2K chunks; device d runs chunk d on the way down and chunk 2K-1-d on the way back, so device
0 holds the first and the last chunk and computes the loss, and device K-1 runs the two middle chunks one after
the other with no transfer between them. Each chunk is half a fill-drain stage, so the fill and the drain are
half as long, and the W cells fill what is left of them.

The order is data (`orders.zero_bubble_v`: its V of chunk devices and ZB-H1's windows over 2K chunks); the loop
is 1F1B's (`windowed_loop.run_training`), and the stage plan places the chunks as the order says. Outside training
it runs fill-drain's forward loop.
"""

from __future__ import annotations

from gpipe_tf.gpipe import orders
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.windowed_loop import WindowedSchedule


class ZeroBubbleV(WindowedSchedule, short_name="zero_bubble_v"):
    """ZB-V: two chunks of layers per device in a V (device d: chunks d and 2K-1-d), W split off B. Knobs: the
    windowed loop's (`batch_weight_gradients`); the model needs at least 2 x num_stages layers."""

    def own_order(self, num_devices: int) -> ScheduleOrder:
        """ZB-V's order: `orders.zero_bubble_v`."""
        return orders.zero_bubble_v(num_devices)
