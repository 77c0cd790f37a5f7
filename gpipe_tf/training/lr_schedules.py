"""Learning-rate schedules: a multiplier of the base learning rate as a function of the global step.

The trainer computes lr = train.learning_rate * schedule(step). Every schedule is pure TensorFlow ops on
the step, so it works eagerly with a Python int and inside `tf.function` with an int64 step tensor. The
arithmetic is done in float64 and only the result is cast to float32: a float32 step is inexact beyond
2^24 (~16.7M steps), which would make long runs' schedules jitter.

The run length: a schedule that decays to an end (`Cosine`) follows `train.max_steps` when its `total_steps` is
None (the default), so a longer run (`--max_steps`, a resume to a later step) stretches the decay over the whole
run. An explicit `total_steps` shorter than `train.max_steps` is refused before training starts (`for_run`):
the steps past it would train at the schedule's final multiplier, often 0.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError

__all__ = ["Schedule", "Constant", "LinearWarmupRsqrtDecay", "Cosine", "StepDecay", "for_run"]


def _is_int(value: Any) -> bool:
    """True for Python/NumPy ints, False for bools (ints to Python, but never a step count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _step_f64(step: Any) -> tf.Tensor:
    """The step as a float64 scalar tensor."""
    return tf.cast(tf.convert_to_tensor(step), tf.float64)


class Schedule:
    """Base schedule: Params in, `__call__(step)` returns a float32 scalar multiplier."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params of this schedule (only `cls` for the base)."""
        return InstantiableParams(cls)

    def __init__(self, params: InstantiableParams) -> None:
        if not isinstance(params, InstantiableParams):
            raise ParamsError(f"{type(self).__name__} expects InstantiableParams from "
                              f"{type(self).__name__}.params(), got {type(params).__name__}")
        p = params.copy()
        self._validate(p)
        p.freeze()
        self._params = p

    @property
    def p(self) -> InstantiableParams:
        """This schedule's frozen Params."""
        return self._params

    def _validate(self, p: InstantiableParams) -> None:
        """Checks the Params; raises ParamsError naming the field, the bad value and the fix."""

    def _error(self, field: str, value: Any, requirement: str) -> ParamsError:
        return ParamsError(f"{type(self).__name__}.{field}={value!r} is invalid: {requirement}")

    def _multiplier(self, step: tf.Tensor) -> tf.Tensor:
        """The multiplier at `step` (a float64 scalar tensor), as a float64 tensor."""
        raise NotImplementedError(f"{type(self).__name__}._multiplier")

    def __call__(self, step: Any) -> tf.Tensor:
        """The learning-rate multiplier at global step `step` (Python int or int tensor), float32 scalar."""
        return tf.cast(self._multiplier(_step_f64(step)), tf.float32)


class Constant(Schedule):
    """Multiplier 1.0 at every step."""

    def _multiplier(self, step: tf.Tensor) -> tf.Tensor:
        return tf.ones_like(step)


class LinearWarmupRsqrtDecay(Schedule):
    """The Transformer schedule normalized to a peak of 1: min((step + 1) / warmup, sqrt(warmup / (step + 1))).

    Linear ramp reaching 1.0 at the last warm-up step (step = warmup_steps - 1), then 1/sqrt decay.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `warmup_steps` (4000)."""
        p = super().params()
        p.define("warmup_steps", 4000, "Steps of linear warm-up to the peak multiplier 1.0; a positive int.")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        if not _is_int(p.warmup_steps) or p.warmup_steps <= 0:
            raise self._error("warmup_steps", p.warmup_steps, "it must be a positive int, e.g. 4000")

    def _multiplier(self, step: tf.Tensor) -> tf.Tensor:
        warmup = tf.constant(float(self.p.warmup_steps), tf.float64)
        s = step + 1.0
        return tf.minimum(s / warmup, tf.sqrt(warmup / s))


class Cosine(Schedule):
    """Linear warm-up from 0 to 1 over `warmup_steps`, then cosine decay to `final_ratio` at `total_steps`.

    multiplier = step / warmup_steps for step < warmup_steps; then
    final_ratio + (1 - final_ratio) * (1 + cos(pi * progress)) / 2 with
    progress = (step - warmup_steps) / (total_steps - warmup_steps) clipped to [0, 1] (so constant after).
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `total_steps` (None: train.max_steps), `warmup_steps` (0), `final_ratio` (0.0)."""
        p = super().params()
        p.define("total_steps", None, "Step at which the cosine reaches final_ratio; a positive int, or None: "
                 "train.max_steps (the decay stretches with the run). Never less than train.max_steps.")
        p.define("warmup_steps", 0, "Steps of linear warm-up from 0 to 1; an int in [0, total_steps).")
        p.define("final_ratio", 0.0, "Multiplier at and after total_steps, in [0, 1].")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        ratio = p.final_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise self._error("final_ratio", ratio, "it must be a number in [0, 1], e.g. 0.0 or 0.1")
        if not _is_int(p.warmup_steps) or p.warmup_steps < 0:
            raise self._error("warmup_steps", p.warmup_steps, "it must be an int >= 0, below total_steps")
        if p.total_steps is None:
            raise self._error("total_steps", p.total_steps, "the run length must be filled in first: build the "
                              "schedule with lr_schedules.for_run(params, max_steps) (the trainer does)")
        if not _is_int(p.total_steps) or p.total_steps <= 0:
            raise self._error("total_steps", p.total_steps,
                              "it must be a positive int, the step where the decay ends (e.g. the run length)")
        if p.warmup_steps >= p.total_steps:
            raise self._error("warmup_steps", p.warmup_steps,
                              f"it must be an int in [0, total_steps={p.total_steps}); lower it or raise "
                              "total_steps")

    def _multiplier(self, step: tf.Tensor) -> tf.Tensor:
        warmup = float(self.p.warmup_steps)
        decay_steps = float(self.p.total_steps - self.p.warmup_steps)
        final = tf.constant(float(self.p.final_ratio), tf.float64)
        progress = tf.clip_by_value((step - warmup) / decay_steps, 0.0, 1.0)
        cosine = final + (1.0 - final) * 0.5 * (1.0 + tf.cos(math.pi * progress))
        if self.p.warmup_steps == 0:
            return cosine
        # max(warmup, 1) only keeps the untaken branch of tf.where free of division by zero.
        ramp = step / max(warmup, 1.0)
        return tf.where(step < warmup, ramp, cosine)


class StepDecay(Schedule):
    """Piecewise-constant decay: decay_factor ** (number of boundaries <= step).

    With `boundaries` empty and `every_n_steps` > 0 the boundaries are every_n_steps, 2 every_n_steps, ...
    With both unset the multiplier is 1.0.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `boundaries` ([]), `decay_factor` (0.1), `every_n_steps` (0)."""
        p = super().params()
        p.define("boundaries", [], "Increasing positive int steps; at each the multiplier is multiplied by "
                 "decay_factor.")
        p.define("decay_factor", 0.1, "Factor applied at each boundary; a positive number.")
        p.define("every_n_steps", 0, "If > 0 (and boundaries empty): decay every this many steps.")
        return p

    def _validate(self, p: InstantiableParams) -> None:
        bounds = p.boundaries
        if not isinstance(bounds, (list, tuple)):
            raise self._error("boundaries", bounds, "it must be a list of increasing positive ints, e.g. "
                              "[30000, 60000]")
        for i, b in enumerate(bounds):
            if not _is_int(b) or b <= 0:
                raise self._error("boundaries", bounds, f"element {i} ({b!r}) is not a positive int")
            if i > 0 and b <= bounds[i - 1]:
                raise self._error("boundaries", bounds,
                                  f"it must be strictly increasing but {bounds[i - 1]!r} is followed by {b!r}; "
                                  "sort it and remove duplicates")
        factor = p.decay_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                math.isfinite(factor) and factor > 0):
            raise self._error("decay_factor", factor, "it must be a positive number, e.g. 0.1")
        if not _is_int(p.every_n_steps) or p.every_n_steps < 0:
            raise self._error("every_n_steps", p.every_n_steps, "it must be an int >= 0 (0 = off)")
        if p.every_n_steps > 0 and bounds:
            raise self._error("every_n_steps", p.every_n_steps,
                              f"it cannot be combined with boundaries={list(bounds)!r}; set one of them only")

    def _multiplier(self, step: tf.Tensor) -> tf.Tensor:
        factor = tf.constant(float(self.p.decay_factor), tf.float64)
        if self.p.boundaries:
            bounds = tf.constant([float(b) for b in self.p.boundaries], tf.float64)
            count = tf.reduce_sum(tf.cast(step >= bounds, tf.float64))
        elif self.p.every_n_steps > 0:
            count = tf.floor(step / float(self.p.every_n_steps))
        else:
            return tf.ones_like(step)
        return tf.pow(factor, count)


def for_run(params: InstantiableParams, max_steps: int) -> Schedule:
    """The schedule of `params` for a run of `max_steps` steps (`train.lr_schedule`, `train.max_steps`).

    A `total_steps` of None becomes `max_steps`; an explicit `total_steps` below `max_steps` raises ParamsError
    naming both fields: the steps after it would train at the final multiplier (lr 0 for a cosine to 0).
    """
    p = params.copy()
    if "total_steps" in p:
        if p.total_steps is None:
            p.total_steps = max_steps
        elif _is_int(p.total_steps) and p.total_steps < max_steps:
            final = p.get("final_ratio") if "final_ratio" in p else None
            at_end = f" (learning rate x {final!r} from then on)" if final is not None else ""
            raise ParamsError(f"train.max_steps={max_steps} runs past the end of the learning-rate schedule, "
                              f"train.lr_schedule.total_steps={p.total_steps}{at_end}; set "
                              f"--params=train.lr_schedule.total_steps={max_steps}, or None to follow "
                              "train.max_steps")
    return p.instantiate()
