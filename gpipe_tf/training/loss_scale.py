"""Loss scaling for float16 training (`train.loss_scale`).

float16 keeps 5 exponent bits: gradients below about 6e-8 become zero, and small activation gradients of a deep
model get there. Scaling the loss by S before the backward pass scales every gradient by S; the learner divides
the float32 weight gradients by S again. bfloat16 has float32's exponent range and needs no scaling.

Dynamic scaling (the usual float16 recipe, as in Keras' LossScaleOptimizer): start at `initial_scale`; a step whose
gradients are not finite overflowed, so its update is skipped (counted in `skipped_steps`) and the scale is divided
by `factor`; after `growth_interval` finite steps in a row the scale is multiplied by `factor`. An overflow at
`min_scale` cannot be cured by a smaller scale: the learner reports it like any non-finite gradient
(`train.skip_nonfinite_steps` decides). The scale and the counters are checkpointed with the run.
"""

from __future__ import annotations

import math

import tensorflow as tf

from gpipe_tf.hyperparams import Params, ParamsError

METHODS = ("auto", "none", "fixed", "dynamic")


def loss_scale_params() -> Params:
    """Default Params of `train.loss_scale`."""
    p = Params()
    p.define("method", "auto", f"One of {METHODS}. auto: dynamic when any layer computes in float16 "
             "(fprop_dtype), else none; fixed: always initial_scale; dynamic: see growth_interval and factor.")
    p.define("initial_scale", 2.0 ** 15, "The scale at the start of training (fixed: the scale).")
    p.define("growth_interval", 2000, "dynamic: multiply the scale by `factor` after this many finite steps in a row.")
    p.define("factor", 2.0, "dynamic: the scale is divided by it after an overflow and multiplied by it to grow.")
    p.define("min_scale", 1.0, "dynamic: the scale never falls below this; an overflow there is a non-finite step.")
    return p


def check_loss_scale_params(p: Params) -> None:
    """Raises ParamsError naming the first bad `train.loss_scale` field, its value and what is allowed."""
    if p.method not in METHODS:
        raise ParamsError(f"train.loss_scale.method={p.method!r} is not one of {METHODS}; e.g. "
                          "--params=train.loss_scale.method=dynamic")
    for name, low in (("initial_scale", 0.0), ("min_scale", 0.0), ("factor", 1.0)):
        value = p.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= low:
            raise ParamsError(f"train.loss_scale.{name}={value!r} must be a finite number > {low}")
    if isinstance(p.growth_interval, bool) or not isinstance(p.growth_interval, int) or p.growth_interval < 1:
        raise ParamsError(f"train.loss_scale.growth_interval={p.growth_interval!r} must be an integer >= 1")
    if p.min_scale > p.initial_scale:
        raise ParamsError(f"train.loss_scale.min_scale={p.min_scale} is above initial_scale={p.initial_scale}; "
                          "lower min_scale or raise initial_scale")


def resolve_method(p: Params, compute_dtypes: set[tf.DType]) -> str:
    """The method in effect: `p.method`, with 'auto' resolved from the model's compute dtypes."""
    check_loss_scale_params(p)
    if p.method == "auto":
        return "dynamic" if tf.float16 in compute_dtypes else "none"
    return p.method


class LossScale(tf.Module):
    """The loss scale of a run and its counters, as variables (checkpointed with the run); see the module doc."""

    def __init__(self, params: Params, method: str) -> None:
        super().__init__(name="loss_scale")
        if method not in ("fixed", "dynamic"):
            raise ValueError(f"LossScale needs method 'fixed' or 'dynamic', got {method!r}")
        self.p = params.copy().freeze()
        self.dynamic = method == "dynamic"
        with tf.init_scope():
            self.scale = tf.Variable(float(self.p.initial_scale), dtype=tf.float32, trainable=False,
                                     name="loss_scale/scale")
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="loss_scale/good_steps")
            self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="loss_scale/skipped_steps")

    def is_expected_overflow(self, grads_finite: tf.Tensor) -> tf.Tensor:
        """Whether non-finite gradients are an overflow the scale handles (dynamic, above min_scale)."""
        if not self.dynamic:
            return tf.constant(False)
        return tf.logical_and(tf.logical_not(grads_finite), self.scale > self.p.min_scale)

    def update(self, step_finite: tf.Tensor) -> None:
        """Counts a skipped step when `step_finite` is False and, if dynamic, shrinks or grows the scale."""
        self.skipped_steps.assign_add(tf.cast(tf.logical_not(step_finite), tf.int64))
        if not self.dynamic:
            return
        factor = tf.constant(self.p.factor, tf.float32)
        good = tf.where(step_finite, self.good_steps + 1, tf.zeros([], tf.int64))
        grow = good >= self.p.growth_interval
        shrunk = tf.maximum(self.scale / factor, tf.constant(self.p.min_scale, tf.float32))
        self.scale.assign(tf.where(step_finite, tf.where(grow, self.scale * factor, self.scale), shrunk))
        self.good_steps.assign(tf.where(grow, tf.zeros([], tf.int64), good))
