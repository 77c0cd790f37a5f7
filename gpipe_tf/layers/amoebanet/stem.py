"""The convolutional stem: image -> 3x3 conv (VALID) -> BN, returned as the pair the cells pass along."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.layers.amoebanet.conv import CONV_SCRATCH_BYTES, Conv2D, ConvScratch
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext
from gpipe_tf.layers.batch_norm import BatchNorm


class ConvStem(ConvScratch, BaseLayer):
    """3x3 conv (stride 2 for ImageNet, 1 for CIFAR; VALID, no bias) -> BN, output (x, x).

    Cells consume and produce (h[i-1], h[i-2]). The first cell has no h[i-2] (its skip_mode is 'none' and it
    ignores the second entry); repeating x keeps every pipeline stage boundary a pair of tensors.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, filters, stride."""
        p = super().params()
        p.define("input_dim", 3, "Image channels.")
        p.define("filters", 32, "Output channels.")
        p.define("stride", 2, "Stride of the 3x3 conv: 2 for the ImageNet stem, 1 for the CIFAR one.")
        return p

    @classmethod
    def scratch_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Half a convolution's scratch: the stem's filter gradient, over few input channels, took 16 MiB where
        the cells' took 32 (`conv.CONV_SCRATCH_BYTES`; measured with `bench.step_memory --at_peak`)."""
        return CONV_SCRATCH_BYTES // 2

    @classmethod
    def _conv(cls, p: InstantiableParams) -> InstantiableParams:
        return Conv2D.params().set(input_dim=p.input_dim, output_dim=p.filters, kernel_size=3, stride=p.stride,
                                   padding="VALID")

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self.create_child("conv", self._conv(self.p))
        self.create_child("bn", BatchNorm.params().set(dim=self.p.filters))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tuple[tf.Tensor, tf.Tensor]:
        """NHWC images -> (x, x)."""
        x = self.children["conv"].fprop(theta["conv"], inputs, ctx)
        x = self.children["bn"].fprop(theta["bn"], x, ctx)
        # Two distinct tensors: a stage boundary that holds one tensor twice has its gradient taken twice by the
        # pipeline's per-stage tapes (the first cell ignores the second entry, whose gradient must stay zero).
        return x, tf.identity(x)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Conv weights plus gamma and beta."""
        return Conv2D.num_params(cls._conv(p)) + 2 * p.filters

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tuple[tf.TensorSpec, tf.TensorSpec]:
        """(conv output spec, the same)."""
        out = Conv2D.output_spec(cls._conv(p), input_spec)
        return out, out

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """Conv and batch norm."""
        out = Conv2D.output_spec(cls._conv(p), input_spec)
        return Conv2D.flops(cls._conv(p), input_spec) + BatchNorm.flops(BatchNorm.params().set(dim=p.filters), out)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The conv's output (the batch norm reads it) and the batch norm's (the pair's second entry is the same
        buffer: an identity copies nothing)."""
        out = Conv2D.output_spec(cls._conv(p), input_spec)
        return Conv2D.activation_bytes(cls._conv(p), input_spec) + BatchNorm.activation_bytes(
            BatchNorm.params().set(dim=p.filters), out)
