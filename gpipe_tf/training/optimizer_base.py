"""The optimizer framework: slot variables created eagerly next to their variables, keyed by variable name.

The pipeline places each stage's variables on that stage's device, and every slot variable (momentum, Adam
moments, Adafactor's row and column statistics, ...) must sit on the same device so that the update never
crosses devices. The contract:

* `Optimizer.build(variables)` creates all slots eagerly, each under `tf.device(var.device)`, before any
  `tf.function` traces. It is idempotent and can be called again to add new variables.
* `Optimizer.apply_gradients(grads_and_vars, learning_rate)` works eagerly or inside `tf.function`, updates
  each variable under its own device and counts steps in `iterations`.
* An optimizer is a `tf.Module`: `tf.train.Checkpoint(optimizer=opt, ...)` saves and restores its slots and
  `iterations`. Slots are keyed by the variable's (unique, deterministic) name, not by creation order, so a
  checkpoint restores into an optimizer built over the same model in any order.

Why not Keras 3's optimizers (keras 3.15; `python -m bench.keras_optimizers` shows it on three logical CPUs, one
variable per device, and docs/experiments.md#why-the-optimizers-are-not-keras-3s quotes its output): Keras'
`Adafactor` creates its row and column statistics on the default device (all three on CPU:0), keeps a full-size
second-moment variable besides them (so factoring saves no memory), and refuses variable names containing '/'.
Its `AdamW` and `use_ema` place their slots correctly, but a `tf.train.Checkpoint` of a Keras optimizer keys the
slots, and a second copy of the model's variables, by their position in `build`'s list: restored into a model
whose variables come in another order, stage 2's weights and moments silently receive stage 0's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError

__all__ = ["Optimizer", "slot_key", "check_range", "as_dtype"]


def _var_base_name(var: tf.Variable) -> str:
    """The variable's name without the ':0' output suffix."""
    return re.sub(r":\d+$", "", var.name)


def slot_key(var: tf.Variable) -> str:
    """The key of `var`'s slots in `Optimizer.slots`: its name without ':0', '/' turned into '.'.

    The key becomes part of the checkpoint path, so it must depend only on the variable's name (stable across
    runs), never on object ids or creation order.
    """
    return re.sub(r"[^\w.\-]", "_", _var_base_name(var).replace("/", "."))


def check_range(p: InstantiableParams, field: str, low: float, high: float, *, low_inclusive: bool = True,
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


def as_dtype(value: tf.Tensor | float, dtype: tf.DType) -> tf.Tensor:
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
        """(slot name, initial value) for every slot each variable gets, of the variable's shape; none by default."""
        return []

    def _slot_shapes(self, var: tf.Variable) -> list[tuple[str, float, tf.TensorShape]]:
        """(slot name, initial value, shape) of `var`'s slots; by default `_slot_specs` at the variable's shape.

        Optimizers whose slots depend on the variable's shape (Adafactor's factored statistics) override this.
        """
        return [(name, init, var.shape) for name, init in self._slot_specs()]

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
                    for slot_name, init, shape in self._slot_shapes(var):
                        var_slots[slot_name] = tf.Variable(
                            tf.fill(shape, tf.constant(init, dtype=var.dtype)),
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
                lr = as_dtype(learning_rate, var.dtype)
                updates.append(self._apply_dense(g, var, slots, lr))
        # The counter is read by the updates (Adam's bias correction uses the pre-increment value), so it
        # must only move after all of them.
        with tf.control_dependencies(tf.nest.flatten(updates)):
            increment = self.iterations.assign_add(1, read_value=False)
        if tf.executing_eagerly():
            return None
        return tf.group(increment)
