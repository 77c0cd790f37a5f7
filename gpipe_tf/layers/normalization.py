"""Layer normalization over the last dimension."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements, sensitive_dtype


class LayerNorm(BaseLayer):
    """Normalizes the last dimension to zero mean and unit variance, then scales and shifts it.

    Half-precision inputs are normalized in float32 with the float32 scale and shift (a bfloat16 scale rounds
    1.001 to 1.0), and the result is cast back to the input's dtype.
    """

    UNCAST_VARIABLES = frozenset({"scale", "bias"})

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: dim, epsilon."""
        p = super().params()
        p.define("dim", 0, "Size of the normalized (last) dimension.")
        p.define("epsilon", 1e-6, "Added to the variance for numerical stability.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        if self.p.dim <= 0:
            raise ParamsError(f"{self.path}: dim must be > 0, got {self.p.dim}")
        self.create_variable("scale", [self.p.dim], init=initializers.weight_init("constant", 1.0))
        self.create_variable("bias", [self.p.dim], init=initializers.weight_init("constant", 0.0))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Returns (x - mean) / sqrt(var + eps) * scale + bias over the last dimension."""
        dtype = sensitive_dtype(inputs.dtype)
        x = tf.cast(inputs, dtype)
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        normed = (x - mean) * tf.math.rsqrt(variance + self.p.epsilon)
        out = normed * tf.cast(theta["scale"], dtype) + tf.cast(theta["bias"], dtype)
        return tf.cast(out, inputs.dtype)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """2 * dim (scale and bias)."""
        return 2 * p.dim

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """Moments, normalize, scale and shift: about 8 ops per element."""
        return 8.0 * num_elements(input_spec)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Unchanged shape and dtype."""
        return input_spec

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """One normalized intermediate (x - mean times the inverse deviation, which the scale's gradient reads) and the
        output: measured in graph mode, where TensorFlow's arithmetic rewrites keep one intermediate where the
        written ops would keep two. A half-precision input also keeps its float32 copy and the float32 output."""
        wide = elements_bytes(input_spec, sensitive_dtype(input_spec.dtype))
        if sensitive_dtype(input_spec.dtype) == tf.as_dtype(input_spec.dtype):
            return 2 * wide
        return 3 * wide + elements_bytes(input_spec)
