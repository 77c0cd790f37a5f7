"""Drop path: drops a whole cell branch for some examples in training (ScheduledDropPath in [AMB]).

The keep probability can ramp in linearly over `burn_in_steps`. The step has to reach the forward pass at run time,
and FPropContext carries no step (the pipeline re-creates the context per micro-batch), so a ramping layer keeps
it in a non-trainable scalar variable, `global_step`, read from theta like any weight; the training loop sets it
through `set_training_step` (the learner calls it before every step). Without a ramp there is no such variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers, stateless_random
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements, sensitive_dtype


def ramped_keep_prob(keep_prob: float, step: Any, burn_in_steps: int) -> Any:
    """Keep probability at `step`: 1.0 at step 0, falling linearly to `keep_prob` at `burn_in_steps`."""
    if burn_in_steps <= 0:
        return keep_prob
    ratio = tf.minimum(tf.cast(step, tf.float64) / burn_in_steps, 1.0)
    return 1.0 - ratio * (1.0 - keep_prob)


class DropPath(BaseLayer):
    """Keeps each example's input with probability keep_prob (divided by it) or zeroes it, in training only.

    The mask is drawn from the stateless seed `ctx.layer_seed(random_id, path)`: a recomputed forward pass and
    every pipeline partition draw the same mask, with or without XLA (`stateless_random`).
    """

    UNCAST_VARIABLES = frozenset({"global_step"})  # a step count: bfloat16 would round it beyond 256

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: keep_prob, burn_in_steps."""
        p = super().params()
        p.define("keep_prob", 1.0, "Probability of keeping an example's path, in (0, 1]; 1.0 disables drop path.")
        p.define("burn_in_steps", 0, "Steps over which the keep probability ramps from 1.0 down to keep_prob; 0: none.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        if not 0.0 < self.p.keep_prob <= 1.0:
            raise ParamsError(f"{self.path}.keep_prob={self.p.keep_prob} must be in (0, 1]")
        if self.p.burn_in_steps > 0:
            self.create_variable("global_step", [], init=initializers.weight_init("constant", 0.0), trainable=False)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Applies the per-example mask when training and keep_prob < 1; otherwise returns `inputs`."""
        p = self.p
        if not ctx.training or p.keep_prob >= 1.0:
            return inputs
        # The draw and the ramp in float32 for half-precision inputs; the mask is 0 or 1 in any dtype.
        dtype = sensitive_dtype(inputs.dtype)
        keep = p.keep_prob
        if p.burn_in_steps > 0:
            keep = tf.cast(ramped_keep_prob(keep, tf.stop_gradient(theta["global_step"]), p.burn_in_steps), dtype)
        shape = tf.concat([tf.shape(inputs)[:1], tf.ones([inputs.shape.rank - 1], tf.int32)], 0)
        uniform = stateless_random.uniform(shape, ctx.layer_seed(self.random_id, self.path), dtype)
        mask = tf.cast(tf.floor(keep + uniform), inputs.dtype)
        return inputs * mask / (keep if isinstance(keep, float) else tf.cast(keep, inputs.dtype))

    def set_training_step(self, step: tf.Tensor) -> None:
        """Moves the ramp-in to `step` (only when drop path ramps in)."""
        if "global_step" in self.vars:
            self.vars["global_step"].assign(tf.cast(step, self.vars["global_step"].dtype))

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """No trainable weights."""
        return 0

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Unchanged."""
        return input_spec

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """A multiply and a divide per element."""
        return 2.0 * num_elements(input_spec)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """In training with keep_prob < 1: the masked input and the output (the divide's gradient reads both
        operands); the per-example mask is negligible. Otherwise nothing."""
        return 0 if p.keep_prob >= 1.0 else 2 * elements_bytes(input_spec)


def set_drop_path_step(module: tf.Module, step: Any) -> None:
    """Sets the step of every ramping DropPath under `module` (call once per training step)."""
    for layer in [module, *module.submodules]:
        if isinstance(layer, DropPath):
            layer.set_training_step(step)
