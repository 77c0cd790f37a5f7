"""SGD, Adam, AdamW and RMSProp on the project's optimizer framework (optimizer_base); gradient clipping.

Adafactor lives in adafactor.py and the weight averages (EMA) in weight_ema.py. `Optimizer` and `slot_key` are
re-exported here, where the optimizers are chosen from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.training.optimizer_base import Optimizer, check_range, slot_key

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSProp", "clip_by_global_norm", "slot_key"]


class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum, TF1/Keras formulation.

    v = momentum * v - lr * g; var += v (Nesterov: var += momentum * v - lr * g, with the new v).
    With momentum 0 there is no slot and the update is var -= lr * g.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `momentum` (0.0) and `nesterov` (False)."""
        p = super().params()
        p.define("momentum", 0.0, "Momentum coefficient in [0, 1); 0 = plain SGD (no slot).")
        p.define("nesterov", False, "Use Nesterov momentum.")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        check_range(p, "momentum", 0.0, 1.0, hint="use e.g. 0.9, or 0.0 for plain SGD")
        if not isinstance(p.nesterov, bool):
            raise ParamsError(f"{p.name}.nesterov={p.nesterov!r} must be True or False")

    def _slot_specs(self) -> list[tuple[str, float]]:
        return [("momentum", 0.0)] if self.p.momentum > 0 else []

    def _apply_dense(self, grad: tf.Tensor, var: tf.Variable, slots: dict[str, tf.Variable],
                     lr: tf.Tensor) -> object:
        if self.p.momentum == 0:
            return var.assign_sub(lr * grad, read_value=False)
        momentum = tf.constant(self.p.momentum, var.dtype)
        velocity = slots["momentum"]
        new_velocity = momentum * velocity - lr * grad
        slot_update = velocity.assign(new_velocity, read_value=False)
        if self.p.nesterov:
            delta = momentum * new_velocity - lr * grad
        else:
            delta = new_velocity
        return [slot_update, var.assign_add(delta, read_value=False)]


class Adam(Optimizer):
    """Adam with bias correction folded into the step size, as in tf.keras / TF1.

    m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; lr_t = lr sqrt(1 - b2^t) / (1 - b1^t);
    var -= lr_t m / (sqrt(v) + epsilon), with t = iterations + 1.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `beta1` (0.9), `beta2` (0.999), `epsilon` (1e-8)."""
        p = super().params()
        p.define("beta1", 0.9, "Decay of the first-moment estimate, in [0, 1).")
        p.define("beta2", 0.999, "Decay of the second-moment estimate, in [0, 1).")
        p.define("epsilon", 1e-8, "Added to sqrt(v) in the denominator, >= 0.")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        check_range(p, "beta1", 0.0, 1.0, hint="the usual value is 0.9")
        check_range(p, "beta2", 0.0, 1.0, hint="the usual value is 0.999 (0.98 for Transformers)")
        check_range(p, "epsilon", 0.0, math.inf, hint="the usual value is 1e-8")

    def _slot_specs(self) -> list[tuple[str, float]]:
        return [("m", 0.0), ("v", 0.0)]

    def _apply_dense(self, grad: tf.Tensor, var: tf.Variable, slots: dict[str, tf.Variable],
                     lr: tf.Tensor) -> object:
        dtype = var.dtype
        beta1 = tf.constant(self.p.beta1, dtype)
        beta2 = tf.constant(self.p.beta2, dtype)
        t = tf.cast(self.iterations + 1, dtype)
        lr_t = lr * tf.sqrt(1 - tf.pow(beta2, t)) / (1 - tf.pow(beta1, t))
        m, v = slots["m"], slots["v"]
        new_m = beta1 * m + (1 - beta1) * grad
        new_v = beta2 * v + (1 - beta2) * tf.square(grad)
        delta = lr_t * new_m / (tf.sqrt(new_v) + tf.constant(self.p.epsilon, dtype))
        return [m.assign(new_m, read_value=False), v.assign(new_v, read_value=False),
                var.assign_sub(delta, read_value=False)]


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019).

    The decay is not part of the gradient (so Adam's moments never see it): each step first shrinks the
    variable, var -= lr * weight_decay * var, with lr the scheduled learning rate (as PyTorch's and Keras'
    AdamW do), then takes the Adam step above. Variables whose name matches `decay_exclude` are not decayed.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: Adam's, `weight_decay` (0.01) and `decay_exclude` ('')."""
        p = super().params()
        p.define("weight_decay", 0.01, "Decoupled weight decay coefficient, >= 0: var -= lr * weight_decay * var "
                 "each step, besides the Adam step.")
        p.define("decay_exclude", "", "Regular expression: variables whose name it matches (re.search) are not "
                 "decayed, e.g. 'bias|norm|scale'; '' decays every variable.")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        super()._validate(p)
        check_range(p, "weight_decay", 0.0, math.inf, hint="the usual values are 0.01 to 0.1")
        try:
            re.compile(p.decay_exclude)
        except (re.error, TypeError) as e:
            raise ParamsError(f"{p.name}.decay_exclude={p.decay_exclude!r} is not a regular expression ({e}); "
                              "use e.g. 'bias|norm', or '' to decay every variable") from None

    def _decays(self, var: tf.Variable) -> bool:
        return self.p.weight_decay > 0 and not (self.p.decay_exclude and re.search(self.p.decay_exclude, var.name))

    def _apply_dense(self, grad: tf.Tensor, var: tf.Variable, slots: dict[str, tf.Variable],
                     lr: tf.Tensor) -> object:
        if not self._decays(var):
            return super()._apply_dense(grad, var, slots, lr)
        decay = var.assign_sub(lr * tf.constant(self.p.weight_decay, var.dtype) * var, read_value=False)
        # The Adam step reads the variable only through its update: ordering it after the decay is enough.
        with tf.control_dependencies([decay]):
            return [decay, super()._apply_dense(grad, var, slots, lr)]


class RMSProp(Optimizer):
    """RMSProp in TF1's formulation (epsilon inside the square root, momentum on the scaled step).

    ms = decay ms + (1 - decay) g^2; centered: mg = decay mg + (1 - decay) g, denom = ms - mg^2, else
    denom = ms; mom = momentum mom + lr g / sqrt(denom + epsilon); var -= mom.
    With momentum 0 there is no `mom` slot (the formula reduces to var -= lr g / sqrt(denom + epsilon)).
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `decay`, `momentum`, `epsilon`, `centered`, `initial_mean_square`."""
        p = super().params()
        p.define("decay", 0.9, "Decay of the mean-square (and mean-gradient) estimates, in [0, 1).")
        p.define("momentum", 0.0, "Momentum coefficient in [0, 1); 0 = no momentum slot.")
        p.define("epsilon", 1e-10, "Added to the mean square inside the square root, >= 0.")
        p.define("centered", False, "Normalize by the estimated variance (ms - mg^2) instead of ms.")
        p.define("initial_mean_square", 0.0,
                 "Initial value of the mean-square slot. TF1's tf.train.RMSPropOptimizer used 1.0 (as in the "
                 "AmoebaNet papers), which damps the first steps; Keras uses 0.0.")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        check_range(p, "decay", 0.0, 1.0, hint="the usual value is 0.9")
        check_range(p, "momentum", 0.0, 1.0, hint="use e.g. 0.9, or 0.0 for none")
        check_range(p, "epsilon", 0.0, math.inf, hint="the usual value is 1e-10 (TF1) or 1e-7 (Keras)")
        check_range(p, "initial_mean_square", 0.0, math.inf, hint="use 0.0 (Keras) or 1.0 (TF1)")
        if not isinstance(p.centered, bool):
            raise ParamsError(f"{p.name}.centered={p.centered!r} must be True or False")

    def _slot_specs(self) -> list[tuple[str, float]]:
        specs = [("ms", float(self.p.initial_mean_square))]
        if self.p.centered:
            specs.append(("mg", 0.0))
        if self.p.momentum > 0:
            specs.append(("mom", 0.0))
        return specs

    def _apply_dense(self, grad: tf.Tensor, var: tf.Variable, slots: dict[str, tf.Variable],
                     lr: tf.Tensor) -> object:
        dtype = var.dtype
        decay = tf.constant(self.p.decay, dtype)
        ms = slots["ms"]
        new_ms = decay * ms + (1 - decay) * tf.square(grad)
        ops = [ms.assign(new_ms, read_value=False)]
        denom = new_ms
        if self.p.centered:
            mg = slots["mg"]
            new_mg = decay * mg + (1 - decay) * grad
            ops.append(mg.assign(new_mg, read_value=False))
            denom = new_ms - tf.square(new_mg)
        step = lr * grad / tf.sqrt(denom + tf.constant(self.p.epsilon, dtype))
        if self.p.momentum > 0:
            mom = slots["mom"]
            step = tf.constant(self.p.momentum, dtype) * mom + step
            ops.append(mom.assign(step, read_value=False))
        ops.append(var.assign_sub(step, read_value=False))
        return ops


def clip_by_global_norm(grads: Sequence[tf.Tensor | None],
                        clip_norm: float) -> tuple[list[tf.Tensor | None], tf.Tensor]:
    """Scales `grads` so their global L2 norm is at most `clip_norm`.

    Each gradient's sum of squares is computed in its own dtype and cast to float64 before the sum, so mixed
    float32/float64/bfloat16 gradients combine without overflow or precision loss. The scale is
    clip_norm / max(norm, clip_norm): gradients with a norm already below `clip_norm` are returned unscaled
    (up to a multiplication by 1), and a non-finite norm makes every gradient NaN, for the trainer's NaN
    check to see rather than a silent partial update. IndexedSlices are densified so duplicate indices
    count correctly.

    Args:
      grads: gradients; None entries (variables without a gradient) pass through as None.
      clip_norm: the maximum global norm; <= 0 disables clipping (the norm is still returned).

    Returns:
      (clipped gradients in the same order, the global norm before clipping as a float32 scalar).
    """
    dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    partial = [tf.cast(tf.reduce_sum(tf.square(g)), tf.float64) for g in dense if g is not None]
    norm64 = tf.sqrt(tf.add_n(partial)) if partial else tf.constant(0.0, tf.float64)
    norm = tf.cast(norm64, tf.float32)
    if clip_norm <= 0:
        return list(dense), norm
    clip64 = tf.constant(clip_norm, tf.float64)
    # An infinite norm would give scale 0: finite gradients would become zeros and look valid. Make the
    # whole step NaN instead, as tf.clip_by_global_norm does, so the failure is seen.
    scale = tf.where(tf.math.is_finite(norm64), clip64 / tf.maximum(norm64, clip64),
                     tf.constant(float("nan"), tf.float64))
    clipped = [None if g is None else g * tf.cast(scale, g.dtype) for g in dense]
    return clipped, norm
