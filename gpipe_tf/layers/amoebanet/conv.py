"""2-D convolutions on NHWC tensors: a full convolution and a depthwise one (channel multiplier 1).

Initialization: the [TPU] AmoebaNet used variance scaling with fan-out. The project's initializers have no
fan-out mode, so both layers default to `he_gaussian` (stddev sqrt(2 / fan_in)), which keeps the activation
variance after each ReLU -> conv stable in the forward pass; every conv in AmoebaNet is followed by batch norm,
which removes the remaining difference in scale.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes

PADDINGS = ("SAME", "VALID")


def as_pair(value: int | Sequence[int], what: str = "value") -> tuple[int, int]:
    """(height, width) from an int (square) or a sequence of two ints."""
    if isinstance(value, int):
        return value, value
    if len(value) != 2:
        raise ParamsError(f"{what} must be an int or a pair (height, width), got {value!r}")
    return int(value[0]), int(value[1])


def output_size(size: int | None, kernel: int, stride: int, padding: str) -> int | None:
    """Spatial output size of a convolution or pooling window along one axis (None stays None)."""
    if size is None:
        return None
    if padding == "SAME":
        return -(-size // stride)
    out = -(-(size - kernel + 1) // stride)
    if out < 1:
        raise ParamsError(f"a VALID window of {kernel} does not fit an input of size {size}; use a larger input")
    return out


def output_hw(spec: tf.TensorSpec, kernel: tuple[int, int], stride: tuple[int, int],
              padding: str) -> tuple[int | None, int | None]:
    """Output (height, width) of a window over an NHWC spec."""
    return (output_size(spec.shape[1], kernel[0], stride[0], padding),
            output_size(spec.shape[2], kernel[1], stride[1], padding))


def check_channels(layer: str, spec: tf.TensorSpec, expected: int) -> None:
    """Raises a ParamsError unless `spec` is NHWC with `expected` channels."""
    if spec.shape.rank != 4 or spec.shape[-1] != expected:
        raise ParamsError(f"{layer} expects an NHWC input with {expected} channels, got shape {spec.shape}")


def _elements(batch: int | None, height: int | None, width: int | None, channels: int) -> int:
    if None in (batch, height, width):
        raise ParamsError("cost estimates need a fully defined input shape (batch, height, width)")
    return batch * height * width * channels


def _check_common(layer: str, p: InstantiableParams) -> None:
    if p.padding not in PADDINGS:
        raise ParamsError(f"{layer}.padding={p.padding!r} is not one of {PADDINGS}")
    if min(as_pair(p.kernel_size, f"{layer}.kernel_size")) < 1 or min(as_pair(p.stride, f"{layer}.stride")) < 1:
        raise ParamsError(f"{layer}: kernel_size and stride must be >= 1, got {p.kernel_size} and {p.stride}")


# TensorFlow 2.21's CPU kernels for a convolution's gradients (Conv2DBackpropInput, Conv2DBackpropFilter) each
# allocate a 32 MiB scratch buffer in a single-thread worker at the sizes measured (`python -m bench.step_memory
# --at_peak` on AmoebaNet stages: docs/memory.md). The planner counts one: ops run one at a time on a device.
CONV_SCRATCH_BYTES = 32 * 2 ** 20


class ConvScratch:
    """Mixin of the layers that run a full 2-D convolution: their backward pass holds CONV_SCRATCH_BYTES."""

    @classmethod
    def scratch_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """One convolution gradient's scratch buffer (CONV_SCRATCH_BYTES)."""
        return CONV_SCRATCH_BYTES


class Conv2D(ConvScratch, BaseLayer):
    """A 2-D convolution, kernel [kh, kw, input_dim, output_dim], no bias by default."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, output_dim, kernel_size, stride, padding, has_bias."""
        p = super().params()
        p.define("input_dim", 0, "Input channels.")
        p.define("output_dim", 0, "Output channels.")
        p.define("kernel_size", 1, "Kernel size: an int (square) or (height, width).")
        p.define("stride", 1, "Stride: an int or (height, width).")
        p.define("padding", "SAME", f"One of {PADDINGS}.")
        p.define("has_bias", False, "Whether to add a bias vector (AmoebaNet convs have none: batch norm follows).")
        p.params_init = initializers.weight_init("he_gaussian")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.input_dim <= 0 or p.output_dim <= 0:
            raise ParamsError(f"{self.path}: input_dim and output_dim must be > 0, got {p.input_dim} and "
                              f"{p.output_dim}")
        _check_common(self.path, p)
        kh, kw = as_pair(p.kernel_size)
        self.create_variable("w", [kh, kw, p.input_dim, p.output_dim])
        if p.has_bias:
            self.create_variable("b", [p.output_dim], init=initializers.weight_init("constant", 0.0))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Convolves NHWC `inputs` with the kernel."""
        sh, sw = as_pair(self.p.stride)
        out = tf.nn.conv2d(inputs, theta["w"], strides=[1, sh, sw, 1], padding=self.p.padding)
        if self.p.has_bias:
            out += theta["b"]
        return out

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """kh * kw * input_dim * output_dim (+ output_dim for the bias)."""
        kh, kw = as_pair(p.kernel_size)
        return kh * kw * p.input_dim * p.output_dim + (p.output_dim if p.has_bias else 0)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """[batch, out_height, out_width, output_dim]."""
        check_channels(cls.__name__, input_spec, p.input_dim)
        h, w = output_hw(input_spec, as_pair(p.kernel_size), as_pair(p.stride), p.padding)
        return tf.TensorSpec([input_spec.shape[0], h, w, p.output_dim], input_spec.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """2 multiply-adds per kernel tap and input channel, for every output element."""
        out = cls.output_spec(p, input_spec)
        kh, kw = as_pair(p.kernel_size)
        return 2.0 * _elements(*out.shape[:3], p.output_dim) * kh * kw * p.input_dim

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The output (the convolution's gradient reads its input and the filter, the bias add's nothing)."""
        return elements_bytes(cls.output_spec(p, input_spec))


class DepthwiseConv2D(BaseLayer):
    """A depthwise 2-D convolution with channel multiplier 1: kernel [kh, kw, dim, 1], no bias."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: dim, kernel_size, stride, padding."""
        p = super().params()
        p.define("dim", 0, "Channels (input and output).")
        p.define("kernel_size", 3, "Kernel size: an int (square) or (height, width).")
        p.define("stride", 1, "Stride, an int: TensorFlow's depthwise convolution needs equal strides.")
        p.define("padding", "SAME", f"One of {PADDINGS}.")
        p.params_init = initializers.weight_init("he_gaussian")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.dim <= 0:
            raise ParamsError(f"{self.path}: dim must be > 0, got {p.dim}")
        _check_common(self.path, p)
        if len(set(as_pair(p.stride))) != 1:
            raise ParamsError(f"{self.path}.stride={p.stride}: a depthwise convolution needs equal strides")
        kh, kw = as_pair(p.kernel_size)
        init = p.params_init
        if init.method == "he_gaussian":
            # The initializer reads fan-in off the [kh, kw, dim, 1] shape as kh * kw * dim, but each output
            # channel of a depthwise filter sees only kh * kw inputs: scale back up to the true fan-in.
            init = init.copy().set(scale=init.scale * math.sqrt(p.dim))
        self.create_variable("w", [kh, kw, p.dim, 1], init=init)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Convolves each channel of NHWC `inputs` with its own filter."""
        s = as_pair(self.p.stride)[0]
        return tf.nn.depthwise_conv2d(inputs, theta["w"], strides=[1, s, s, 1], padding=self.p.padding)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """kh * kw * dim."""
        kh, kw = as_pair(p.kernel_size)
        return kh * kw * p.dim

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """[batch, out_height, out_width, dim]."""
        check_channels(cls.__name__, input_spec, p.dim)
        h, w = output_hw(input_spec, as_pair(p.kernel_size), as_pair(p.stride), p.padding)
        return tf.TensorSpec([input_spec.shape[0], h, w, p.dim], input_spec.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """2 multiply-adds per kernel tap, for every output element."""
        out = cls.output_spec(p, input_spec)
        kh, kw = as_pair(p.kernel_size)
        return 2.0 * _elements(*out.shape[:3], p.dim) * kh * kw

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The output (the gradient reads the input and the filter)."""
        return elements_bytes(cls.output_spec(p, input_spec))
