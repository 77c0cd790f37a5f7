"""Batch normalization with GPipe's micro-batch semantics.

In training, each call normalizes with the statistics of the batch it sees (in a pipeline: the micro-batch) and
reports the sum, sum of squares and count of its input in `ctx.aux`. The pipeline adds these up over the
micro-batches, and the learner updates the moving averages once per step from the full mini-batch statistics.
Variables are never assigned inside the forward pass, so a recomputed forward (rematerialization) cannot update
them twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements, sensitive_dtype


class BatchNorm(BaseLayer):
    """Normalizes the last (channel) dimension over all other dimensions.

    Half-precision inputs are normalized in float32, with float32 statistics and weights; the statistics reported
    in `ctx.aux` are in the variables' dtype, and the output has the input's dtype.
    """

    UNCAST_VARIABLES = frozenset({"gamma", "beta", "moving_mean", "moving_variance"})

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: dim, decay, epsilon."""
        p = super().params()
        p.define("dim", 0, "Channels (last dimension).")
        p.define("decay", 0.9, "Moving average decay: moving = decay * moving + (1 - decay) * batch statistic.")
        p.define("epsilon", 1e-5, "Added to the variance.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.dim <= 0:
            raise ParamsError(f"{self.path}: dim must be > 0, got {p.dim}")
        if not 0.0 <= p.decay < 1.0:
            raise ParamsError(f"{self.path}.decay={p.decay} must be in [0, 1)")
        self.create_variable("gamma", [p.dim], init=initializers.weight_init("constant", 1.0))
        self.create_variable("beta", [p.dim], init=initializers.weight_init("constant", 0.0))
        self.create_variable("moving_mean", [p.dim], init=initializers.weight_init("constant", 0.0), trainable=False)
        self.create_variable("moving_variance", [p.dim], init=initializers.weight_init("constant", 1.0),
                             trainable=False)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Normalizes with batch statistics in training (recording them in ctx.aux), moving ones otherwise."""
        axes = list(range(inputs.shape.rank - 1))
        dtype = sensitive_dtype(inputs.dtype)
        x = tf.cast(inputs, dtype)
        if ctx.training:
            mean, variance = tf.nn.moments(x, axes)
            if ctx.aux is not None:
                count = tf.cast(tf.size(x) // tf.shape(x)[-1], dtype)
                xs = tf.stop_gradient(x)
                sums = (tf.reduce_sum(xs, axes), tf.reduce_sum(tf.square(xs), axes), count)
                ctx.aux[self.path] = tuple(tf.cast(t, self.dtype) for t in sums)  # in the moving averages' dtype
        else:
            mean, variance = theta["moving_mean"], theta["moving_variance"]
        beta, gamma = tf.cast(theta["beta"], dtype), tf.cast(theta["gamma"], dtype)
        out = tf.nn.batch_normalization(x, tf.cast(mean, dtype), tf.cast(variance, dtype), beta, gamma,
                                        self.p.epsilon)
        return tf.cast(out, inputs.dtype)

    def aux_stats_spec(self) -> dict[str, Any]:
        """(sum, sum of squares) per channel and the element count per channel."""
        vec = tf.TensorSpec([self.p.dim], self.dtype)
        return {self.path: (vec, vec, tf.TensorSpec([], self.dtype))}

    def apply_aux_stats(self, aux: Mapping[str, Any]) -> None:
        """Moves the moving averages towards the full mini-batch statistics reported in `aux`."""
        if self.path not in aux:
            return
        total, total_sq, count = aux[self.path]
        mean = total / count
        variance = tf.maximum(total_sq / count - tf.square(mean), 0.0)
        # tf.constant, not tf.cast: a Python float cast to float64 passes through float32 (0.9 -> 0.8999999762).
        decay = tf.constant(self.p.decay, self.dtype)
        self.vars["moving_mean"].assign(decay * self.vars["moving_mean"] + (1 - decay) * mean)
        self.vars["moving_variance"].assign(decay * self.vars["moving_variance"] + (1 - decay) * variance)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """gamma and beta (moving statistics are not trainable)."""
        return 2 * p.dim

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Unchanged shape and dtype."""
        return input_spec

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """Moments and normalization: about 8 ops per element."""
        return 8.0 * num_elements(input_spec)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The output (x * inv reads x, the input; the shift add reads nothing; the statistics are per channel);
        a half-precision input also keeps its float32 copy."""
        wide = sensitive_dtype(input_spec.dtype)
        if wide == tf.as_dtype(input_spec.dtype):
            return elements_bytes(input_spec)
        return 2 * elements_bytes(input_spec, wide) + elements_bytes(input_spec)
