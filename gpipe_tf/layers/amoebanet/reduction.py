"""Factorized reduction (paper_facts §3): halves the spatial size without a strided 1x1 conv dropping 3/4 of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.amoebanet.conv import Conv2D, ConvScratch, check_channels, output_hw
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements
from gpipe_tf.layers.batch_norm import BatchNorm


class FactorizedReduction(ConvScratch, BaseLayer):
    """[ReLU ->] two 1x1 convs to output_dim / 2 on two pixel grids offset by one, concatenated, then BN.

    Path 1 subsamples with stride 2; path 2 first shifts the image by one pixel (pad bottom and right, drop the
    first row and column), so the two paths together see every other pixel of both phases. With stride 1 this
    is a single 1x1 conv to output_dim and BN (used to match the channels of a concatenated cell input).
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, output_dim, stride, relu."""
        p = super().params()
        p.define("input_dim", 0, "Input channels.")
        p.define("output_dim", 0, "Output channels; must be even when stride is 2.")
        p.define("stride", 2, "2 (factorized reduction) or 1 (a plain 1x1 conv).")
        p.define("relu", False, "Whether a ReLU comes first.")
        return p

    @classmethod
    def _convs(cls, p: InstantiableParams) -> list[InstantiableParams]:
        if p.stride not in (1, 2):
            raise ParamsError(f"FactorizedReduction.stride={p.stride} must be 1 or 2")
        if p.stride == 1:
            return [Conv2D.params().set(input_dim=p.input_dim, output_dim=p.output_dim)]
        if p.output_dim % 2:
            raise ParamsError(f"a factorized reduction needs an even number of output channels, got {p.output_dim} "
                              "(each of its two paths makes half); choose filters so that every cell width is even")
        half = Conv2D.params().set(input_dim=p.input_dim, output_dim=p.output_dim // 2, stride=2)
        return [half, half.copy()]

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self.create_children("conv", self._convs(self.p))
        self.create_child("bn", BatchNorm.params().set(dim=self.p.output_dim))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Reduces `inputs` spatially by `stride` to output_dim channels."""
        x = tf.nn.relu(inputs) if self.p.relu else inputs
        if self.p.stride == 1:
            out = self.children["conv_0"].fprop(theta["conv_0"], x, ctx)
        else:
            shifted = tf.pad(x, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:, :]
            out = tf.concat([self.children["conv_0"].fprop(theta["conv_0"], x, ctx),
                             self.children["conv_1"].fprop(theta["conv_1"], shifted, ctx)], axis=-1)
        return self.children["bn"].fprop(theta["bn"], out, ctx)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The 1x1 convs plus gamma and beta."""
        return sum(Conv2D.num_params(cp) for cp in cls._convs(p)) + 2 * p.output_dim

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """[batch, ceil(height / stride), ceil(width / stride), output_dim]."""
        check_channels(cls.__name__, input_spec, p.input_dim)
        h, w = output_hw(input_spec, (1, 1), (p.stride, p.stride), "SAME")
        return tf.TensorSpec([input_spec.shape[0], h, w, p.output_dim], input_spec.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """ReLU, convs and batch norm."""
        out = cls.output_spec(p, input_spec)
        relu = num_elements(input_spec) if p.relu else 0
        convs = sum(Conv2D.flops(cp, input_spec) for cp in cls._convs(p))
        return relu + convs + BatchNorm.flops(BatchNorm.params().set(dim=p.output_dim), out)

    @classmethod
    def leading_relu(cls, p: InstantiableParams) -> bool:
        """Whether it starts with a ReLU of its input."""
        return bool(p.relu)

    @classmethod
    def reads_input(cls, p: InstantiableParams) -> bool:
        """Without a ReLU first, the convs' gradients read the input itself."""
        return not p.relu

    @classmethod
    def internal_activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The shifted copy path 2 convolves (stride 2) and the convs' concatenation (the batch norm reads it; the
        concat's gradient reads only shapes, so the halves go)."""
        shifted = elements_bytes(input_spec) if p.stride == 2 else 0
        return shifted + elements_bytes(cls.output_spec(p, input_spec))

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The ReLU's output, the internal tensors (`internal_activation_bytes`) and the batch norm's output."""
        relu = elements_bytes(input_spec) if p.relu else 0
        return relu + cls.internal_activation_bytes(p, input_spec) + elements_bytes(cls.output_spec(p, input_spec))
