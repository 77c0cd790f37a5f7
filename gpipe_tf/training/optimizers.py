"""Small hand-written optimizers whose slot variables live next to their variables.

Why not Keras optimizers: the pipeline places each stage's variables on that stage's device, and every slot
variable (momentum, Adam moments, ...) must sit on the same device so the update never crosses devices. Keras
creates slots lazily on the first `apply_gradients`, which inside a `tf.function` means during tracing and on
whatever device is current then. Here the contract is explicit:

* `Optimizer.build(variables)` creates all slots eagerly, each under `tf.device(var.device)`, before any
  `tf.function` traces. It is idempotent and can be called again to add new variables.
* `Optimizer.apply_gradients(grads_and_vars, learning_rate)` works eagerly or inside `tf.function`, updates
  each variable under its own device and counts steps in `iterations`.
* An optimizer is a `tf.Module`: `tf.train.Checkpoint(optimizer=opt, ...)` saves and restores its slots and
  `iterations`. Slots are keyed by the variable's (unique, deterministic) name, not by creation order, so a
  checkpoint restores into an optimizer built over the same model in any order.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError

__all__ = ["Optimizer", "SGD", "Adam", "RMSProp", "clip_by_global_norm", "slot_key"]


def _var_base_name(var: tf.Variable) -> str:
    """The variable's name without the ':0' output suffix."""
    return re.sub(r":\d+$", "", var.name)


def slot_key(var: tf.Variable) -> str:
    """The key of `var`'s slots in `Optimizer.slots`: its name without ':0', '/' turned into '.'.

    The key becomes part of the checkpoint path, so it must depend only on the variable's name (stable across
    runs), never on object ids or creation order.
    """
    return re.sub(r"[^\w.\-]", "_", _var_base_name(var).replace("/", "."))


def _check_range(p: InstantiableParams, field: str, low: float, high: float, *, low_inclusive: bool = True,
                 high_inclusive: bool = False, hint: str = "") -> None:
    """Raises ParamsError unless `low <= p.field < high` (bounds per the flags)."""
    value = getattr(p, field)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= low if low_inclusive else value > low) and (value <= high if high_inclusive else value < high)
    if not ok:
        lo = "[" if low_inclusive else "("
        hi = "]" if high_inclusive else ")"
        raise ParamsError(f"{p.name}.{field}={value!r} is out of range: it must be a number in "
                          f"{lo}{low}, {high}{hi}{'; ' + hint if hint else ''}")


def _as_dtype(value: tf.Tensor | float, dtype: tf.DType) -> tf.Tensor:
    """`value` as a `dtype` tensor; Python numbers go straight to `dtype`.

    tf.cast of a Python float would first make a float32 tensor, rounding e.g. 0.1 before the float64 cast.
    """
    if isinstance(value, (int, float)):
        return tf.constant(value, dtype)
    return tf.cast(value, dtype)


class Optimizer(tf.Module):
    """Base optimizer: eager slot creation per variable device, `apply_gradients`, an `iterations` counter.

    Subclasses declare their slots in `_slot_specs` and the per-variable update in `_apply_dense`.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `name` (the class name in lower case)."""
        p = InstantiableParams(cls)
        p.define("name", cls.__name__.lower(), "Optimizer name, used for its tf.Module name and error messages.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        if not isinstance(params, InstantiableParams):
            raise ParamsError(f"{type(self).__name__} expects InstantiableParams from "
                              f"{type(self).__name__}.params(), got {type(params).__name__}")
        p = params.copy()
        if not p.name:
            p.name = type(self).__name__.lower()
        self._validate(p)
        p.freeze()
        # tf.Module names must be identifiers; the Params keep the name as given.
        super().__init__(name=re.sub(r"\W", "_", p.name))
        self._params = p
        # Lifted out of any enclosing tf.function so the counter is a real, checkpointable variable.
        with tf.init_scope():
            self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name=f"{p.name}/iterations")
        # slot key -> {slot name -> slot variable}. Tracked by tf.Module, hence saved by tf.train.Checkpoint.
        # Every built variable has an entry, even with no slots, so "was it built?" has one answer.
        self.slots: dict[str, dict[str, tf.Variable]] = {}
        # slot key -> reference of the variable that owns the slots; catches two distinct variables with the
        # same name (e.g. two unnamed 'Variable:0'), which would otherwise silently share slots.
        self._owners: dict[str, object] = {}

    @property
    def p(self) -> InstantiableParams:
        """This optimizer's frozen Params."""
        return self._params

    def _validate(self, p: InstantiableParams) -> None:
        """Checks the Params; subclasses raise ParamsError naming the field, the value and the fix."""

    def _slot_specs(self) -> list[tuple[str, float]]:
        """(slot name, initial value) for every slot each variable gets; none by default."""
        return []

    def _apply_dense(self, grad: tf.Tensor, var: tf.Variable, slots: dict[str, tf.Variable],
                     lr: tf.Tensor) -> object:
        """Updates `var` (and its slots) from `grad`; runs under `tf.device(var.device)`. Returns the ops."""
        raise NotImplementedError(f"{type(self).__name__}._apply_dense")

    def build(self, variables: Sequence[tf.Variable]) -> None:
        """Creates the slot variables of `variables` eagerly, each on its variable's device.

        Call it once after the model is built and before the first traced step. Calling it again with the same
        variables does nothing; new variables get their slots added.

        Raises:
          ValueError: two distinct variables map to the same slot key (duplicate or clashing names), or a
            variable's shape is not fully defined.
        """
        specs = self._slot_specs()
        # Slots must exist before tracing; init_scope also makes a call from inside tf.function create them
        # eagerly instead of failing on the second trace.
        with tf.init_scope():
            for var in variables:
                key = slot_key(var)
                owner = self._owners.get(key)
                if owner is not None:
                    if owner != var.ref():
                        raise ValueError(
                            f"optimizer {self.p.name!r}: variables {owner.deref().name!r} and {var.name!r} "
                            f"share the slot key {key!r}; give every variable a unique name")
                    continue
                if not var.shape.is_fully_defined():
                    raise ValueError(f"optimizer {self.p.name!r}: variable {var.name!r} has shape {var.shape}; "
                                     "slots need a fully defined shape")
                base = _var_base_name(var)
                var_slots = {}
                with tf.device(var.device):
                    for slot_name, init in specs:
                        var_slots[slot_name] = tf.Variable(
                            tf.fill(var.shape, tf.constant(init, dtype=var.dtype)),
                            trainable=False, name=f"{base}/{slot_name}")
                self.slots[key] = var_slots
                self._owners[key] = var.ref()

    def get_slot(self, var: tf.Variable, slot_name: str) -> tf.Variable:
        """The slot variable `slot_name` of `var` (e.g. 'm' of Adam)."""
        return self._slots_of(var)[slot_name]

    def _slots_of(self, var: tf.Variable) -> dict[str, tf.Variable]:
        key = slot_key(var)
        if key not in self.slots:
            raise ValueError(f"optimizer {self.p.name!r} has no slots for variable {var.name!r}: "
                             "call optimizer.build(variables) before the first step")
        return self.slots[key]

    def apply_gradients(self, grads_and_vars: Iterable[tuple[tf.Tensor | None, tf.Variable]],
                        learning_rate: tf.Tensor | float) -> tf.Operation | None:
        """Applies one step of updates; skips None gradients; increments `iterations` once.

        Works eagerly and inside `tf.function`. `learning_rate` is a Python float or a scalar tensor (cast to
        each variable's dtype). IndexedSlices gradients (from gathers) are densified: the updates here have
        dense semantics, like TF1's non-lazy optimizers.

        Returns:
          Inside `tf.function`, an op that runs after every update and the counter increment; eagerly (where
          everything has already run) None.
        """
        updates = []
        for grad, var in grads_and_vars:
            if grad is None:
                continue
            slots = self._slots_of(var)
            with tf.device(var.device):
                g = tf.convert_to_tensor(grad)
                if g.dtype != var.dtype:
                    raise ValueError(f"optimizer {self.p.name!r}: gradient of {var.name!r} has dtype "
                                     f"{g.dtype.name}, the variable {var.dtype.name}")
                lr = _as_dtype(learning_rate, var.dtype)
                updates.append(self._apply_dense(g, var, slots, lr))
        # The counter is read by the updates (Adam's bias correction uses the pre-increment value), so it
        # must only move after all of them.
        with tf.control_dependencies(tf.nest.flatten(updates)):
            increment = self.iterations.assign_add(1, read_value=False)
        if tf.executing_eagerly():
            return None
        return tf.group(increment)


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
        _check_range(p, "momentum", 0.0, 1.0, hint="use e.g. 0.9, or 0.0 for plain SGD")
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
        _check_range(p, "beta1", 0.0, 1.0, hint="the usual value is 0.9")
        _check_range(p, "beta2", 0.0, 1.0, hint="the usual value is 0.999 (0.98 for Transformers)")
        _check_range(p, "epsilon", 0.0, math.inf, hint="the usual value is 1e-8")

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
        _check_range(p, "decay", 0.0, 1.0, hint="the usual value is 0.9")
        _check_range(p, "momentum", 0.0, 1.0, hint="use e.g. 0.9, or 0.0 for none")
        _check_range(p, "epsilon", 0.0, math.inf, hint="the usual value is 1e-10 (TF1) or 1e-7 (Keras)")
        _check_range(p, "initial_mean_square", 0.0, math.inf, hint="use 0.0 (Keras) or 1.0 (TF1)")
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
