"""Dropout with stateless randomness: the mask is a function of (ctx.seed, layer id) only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import stateless_random
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements, sensitive_dtype


class Dropout(BaseLayer):
    """Zeroes each element with probability `rate` in training and scales the rest by 1 / (1 - rate).

    The mask comes from `stateless_random.uniform` seeded by the caller's `ctx.seed` folded with this layer's
    `random_id`, so a recomputed forward pass (rematerialization) draws exactly the same mask, with or without XLA.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: rate, noise_shape_broadcast_dims."""
        p = super().params()
        p.define("rate", 0.0, "Probability of dropping an element, in [0, 1).")
        p.define("noise_shape_broadcast_dims", None,
                 "None, or a list of dims along which the mask is shared (e.g. [1] for one mask per sequence).")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        if not 0.0 <= self.p.rate < 1.0:
            raise ParamsError(f"{self.path}.rate={self.p.rate} must be in [0, 1)")

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Applies dropout when `ctx.training` and rate > 0; otherwise returns `inputs`."""
        rate = self.p.rate
        if not ctx.training or rate == 0.0:
            return inputs
        shape = tf.shape(inputs)
        if self.p.noise_shape_broadcast_dims:
            dims = set(self.p.noise_shape_broadcast_dims)
            shape = tf.stack([1 if i in dims else shape[i] for i in range(inputs.shape.rank)])
        # Drawn in float32 for half-precision inputs: bfloat16's 8-bit mantissa would coarsen the rate.
        uniform = stateless_random.uniform(shape, ctx.layer_seed(self.random_id, self.path),
                                           sensitive_dtype(inputs.dtype))
        keep = tf.cast(uniform >= rate, inputs.dtype)
        return inputs * keep / (1.0 - rate)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """No weights."""
        return 0

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """Random draw, compare and scale per element."""
        return 3.0 * num_elements(input_spec)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """In training with rate > 0: the keep mask (the multiply's gradient reads it) and the output (a divide by a
        constant keeps nothing of its input); with rate 0 the input passes through and nothing is kept."""
        return 0 if p.rate == 0.0 else 2 * elements_bytes(input_spec)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Unchanged shape and dtype."""
        return input_spec
