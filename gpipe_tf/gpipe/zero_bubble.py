"""Zero bubble, ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each stage's backward
split into B, the input gradient the previous stage waits for, and W, the weight gradients only the optimizer
needs, so that W fills the bubbles.

The order is data (`orders.zero_bubble`): 1F1B's in-flight windows K - k counted on B alone, and a weight window
of K - k: stage k starts micro-batch i after its B of micro-batch i - (K - k) and its W of the same one. The loop
is 1F1B's (`windowed_loop.run_training`): the token a forward waits for depends on the input gradient only, so the next
forward need not wait for the weight-gradient matmuls, which TensorFlow's gradient already builds as their own
ops; a second ring of tokens, filled by the weight-gradient sums, bounds how many wait. Within that bound the
worker's executor runs W's ops as their inputs arrive, so how far W actually lags is its choice. With
`batch_weight_gradients` the matmul weights' W leaves the loop instead: it runs after each stage's last backward,
one matmul per weight over every micro-batch (`batched_weights.py`). Same math, same placement and the same
graph constant in M as 1F1B. Outside training it runs fill-drain's forward loop.
"""

from __future__ import annotations

from gpipe_tf.gpipe import orders
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.windowed_loop import WindowedSchedule


class ZeroBubble(WindowedSchedule, short_name="zero_bubble"):
    """ZB-H1: 1F1B's order with the weight gradients (W) split off the backward (B) and free to fill bubbles."""

    def own_order(self, num_devices: int) -> ScheduleOrder:
        """ZB-H1's order: `orders.zero_bubble`."""
        return orders.zero_bubble(num_devices)
