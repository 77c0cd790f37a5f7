"""Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018).

Lingvo's optimizer for its large Transformers. A matrix's second moment is kept factored, as a row mean and a
column mean of the squared gradient (n + m numbers for an n x m matrix instead of n * m), and rebuilt as their
outer product over the mean of the rows (the paper's Algorithm 4 with means instead of sums, as Lingvo and T5 do):

  beta2_t = 1 - t^(-decay_exponent)                      (t = iterations + 1; beta2_1 = 0, no bias correction)
  R = beta2_t R + (1 - beta2_t) mean_cols(g^2 + eps1);  C = beta2_t C + (1 - beta2_t) mean_rows(g^2 + eps1)
  V = R C / mean(R)      (factored: the last two dimensions, when both are >= min_dim_size_to_factor)
  V = beta2_t V + (1 - beta2_t) (g^2 + eps1)                                    (otherwise: a full slot)
  U = g / sqrt(V);  U /= max(1, RMS(U) / clipping_threshold)                    (update clipping)
  step = lr * max(eps2, RMS(var)) * U   (multiply_by_parameter_scale; else lr * U)
  optional first moment (beta1 > 0): m = beta1 m + (1 - beta1) step; var -= m   (else var -= step)

The learning rate is the trainer's (train.learning_rate times the schedule), so any schedule applies; the
paper's relative step size min(1e-2, 1/sqrt(t)) decays as LinearWarmupRsqrtDecay with learning_rate 1e-2 and
warmup_steps 10000 does after its warm-up (a linear ramp instead of the paper's constant 1e-2). Slots live on
their variable's device and checkpoint by name, as every optimizer of optimizer_base does.
"""

from __future__ import annotations

import math

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.training.optimizer_base import Optimizer, check_range

__all__ = ["Adafactor"]


def _rms(x: tf.Tensor) -> tf.Tensor:
    return tf.sqrt(tf.reduce_mean(tf.square(x)))


class Adafactor(Optimizer):
    """Adafactor with factored second moments, update clipping, relative step size and optional momentum."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: the paper's (and Lingvo's) values; `beta1` 0 (no first-moment slot)."""
        p = super().params()
        p.define("decay_exponent", 0.8, "beta2_t = 1 - t^(-decay_exponent); in (0, 1].")
        p.define("beta1", 0.0, "First-moment (momentum) decay in [0, 1); 0 keeps no first moment (the paper's "
                 "memory-saving setting).")
        p.define("clipping_threshold", 1.0, "Update clipping: the update's RMS is scaled down to at most this, > 0.")
        p.define("epsilon1", 1e-30, "Added to the squared gradient, >= 0.")
        p.define("epsilon2", 1e-3, "Smallest parameter scale (RMS of the variable) of the relative step, >= 0.")
        p.define("multiply_by_parameter_scale", True, "Relative step: scale the learning rate by max(epsilon2, "
                 "RMS(var)), so it is relative to the variable's size.")
        p.define("factored", True, "Keep the second moment of matrices (and of higher-rank variables, over the last "
                 "two dimensions) factored as row and column means.")
        p.define("min_dim_size_to_factor", 128, "Factor only when both of the last two dimensions are at least this "
                 "(Lingvo's default); smaller variables get a full second-moment slot.")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        check_range(p, "decay_exponent", 0.0, 1.0, low_inclusive=False, high_inclusive=True,
                    hint="the paper's value is 0.8")
        check_range(p, "beta1", 0.0, 1.0, hint="use 0.0 (none) or e.g. 0.9")
        check_range(p, "clipping_threshold", 0.0, math.inf, low_inclusive=False, hint="the paper's value is 1.0")
        check_range(p, "epsilon1", 0.0, math.inf, hint="the paper's value is 1e-30")
        check_range(p, "epsilon2", 0.0, math.inf, hint="the paper's value is 1e-3")
        for name in ("multiply_by_parameter_scale", "factored"):
            if not isinstance(p.get(name), bool):
                raise ParamsError(f"{p.name}.{name}={p.get(name)!r} must be True or False")
        size = p.min_dim_size_to_factor
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ParamsError(f"{p.name}.min_dim_size_to_factor={size!r} must be an integer >= 1 (Lingvo uses 128)")

    def is_factored(self, shape: tf.TensorShape) -> bool:
        """Whether a variable of `shape` keeps row and column statistics instead of a full second moment."""
        return (self.p.factored and shape.rank >= 2
                and min(shape[-2], shape[-1]) >= self.p.min_dim_size_to_factor)

    def _slot_shapes(self, var: tf.Variable) -> list[tuple[str, float, tf.TensorShape]]:
        shape = var.shape
        if self.is_factored(shape):
            slots = [("vr", 0.0, shape[:-1]), ("vc", 0.0, shape[:-2].concatenate(shape[-1:]))]
        else:
            slots = [("v", 0.0, shape)]
        if self.p.beta1 > 0:
            slots.append(("m", 0.0, shape))
        return slots

    def _apply_dense(self, grad: tf.Tensor, var: tf.Variable, slots: dict[str, tf.Variable],
                     lr: tf.Tensor) -> object:
        dtype = var.dtype
        one = tf.constant(1.0, dtype)
        t = tf.cast(self.iterations + 1, dtype)
        beta2 = one - tf.pow(t, -tf.constant(self.p.decay_exponent, dtype))
        grad_sq = tf.square(grad) + tf.constant(self.p.epsilon1, dtype)
        ops = []
        if "vr" in slots:
            vr, vc = slots["vr"], slots["vc"]
            new_vr = beta2 * vr + (one - beta2) * tf.reduce_mean(grad_sq, axis=-1)
            new_vc = beta2 * vc + (one - beta2) * tf.reduce_mean(grad_sq, axis=-2)
            ops += [vr.assign(new_vr, read_value=False), vc.assign(new_vc, read_value=False)]
            row_scale = new_vr / tf.reduce_mean(new_vr, axis=-1, keepdims=True)
            v = tf.expand_dims(row_scale, -1) * tf.expand_dims(new_vc, -2)
        else:
            v = beta2 * slots["v"] + (one - beta2) * grad_sq
            ops.append(slots["v"].assign(v, read_value=False))
        update = grad * tf.math.rsqrt(v)
        update /= tf.maximum(one, _rms(update) / tf.constant(self.p.clipping_threshold, dtype))
        step_size = lr
        if self.p.multiply_by_parameter_scale:
            step_size *= tf.maximum(tf.constant(self.p.epsilon2, dtype), _rms(var))
        step = step_size * update
        if self.p.beta1 > 0:
            beta1 = tf.constant(self.p.beta1, dtype)
            step = beta1 * slots["m"] + (one - beta1) * step
            ops.append(slots["m"].assign(step, read_value=False))
        # RMS(var) above reads the variable before this update (the paper's RMS(X_{t-1})).
        with tf.control_dependencies(ops):
            ops.append(var.assign_sub(step, read_value=False))
        return ops
