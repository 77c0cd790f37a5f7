"""Interleaved 1F1B (Megatron-LM): each device runs v non-adjacent chunks of layers, which shrinks the bubble.

With K devices and v virtual stages per device the plan has v*K chunks and puts chunk c on device c mod K, so
device d runs chunks d, K + d, ..., (v-1)K + d of the layer sequence (`plan.make_plan`). A micro-batch visits every
device v times, once per lap; a chunk is 1/v of a fill-drain stage's work, so the fill and the drain are v times
shorter: the bubble goes from (K-1)/(M+K-1) toward (K-1)/(vM+K-1), at the price of v times the stage-boundary
transfers.

The order is data (`orders.interleaved`), run by the loop of 1F1B (`windowed_loop.run_training`) over the v*K
chunks: micro-batch i's forward through every chunk, its loss and its backward in one iteration, and chunk c
starting micro-batch i only after its backward of micro-batch i - (vK - c). As in Megatron-LM,
micro-batches go in groups of K: device d's first chunk starts micro-batch i only after its last chunk's forward
of micro-batch i - K (the order's `forward_waits`; without them a device runs its first chunk's forwards ahead,
as far as the in-flight bound lets it, and its later chunks' cells wait behind them, which widens the bubble),
so M must be a multiple of K.
"""

from __future__ import annotations

from gpipe_tf.gpipe import orders
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.windowed_loop import WindowedSchedule
from gpipe_tf.hyperparams import InstantiableParams, ParamsError


class Interleaved(WindowedSchedule, short_name="interleaved"):
    """Megatron-LM's interleaved 1F1B: v chunks of layers per device, chunk l*K + d on device d in lap l."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: virtual_stages."""
        p = super().params()
        p.define("virtual_stages", 2, "v: chunks of layers per device. The pipeline has v x num_stages chunks; "
                 "num_micro_batches must be a multiple of num_stages.")
        return p

    def __init__(self, params: InstantiableParams, path: str = "") -> None:
        super().__init__(params, path)
        value = self.p.virtual_stages
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ParamsError(f"{path}.schedule.virtual_stages={value!r} must be a whole number >= 1 (2 or more "
                              "interleaves; 1 is OneForwardOneBackward)")

    def own_order(self, num_devices: int) -> ScheduleOrder:
        """Megatron-LM's interleaved order on v = virtual_stages chunks per device (`orders.interleaved`)."""
        return orders.interleaved(num_devices, self.p.virtual_stages)
