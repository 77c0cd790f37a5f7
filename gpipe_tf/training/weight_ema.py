"""Exponential moving average (EMA) of the trained weights, for evaluation, decoding and export.

With `train.ema_decay` = d > 0, every applied optimizer step (a skipped non-finite step is not one) updates
  average = d * average + (1 - d) * weight,
except the first update, which copies the weights (so the average never mixes in a zero or a pre-fine-tuning
initialization). Only trainable variables are averaged: batch-norm moving statistics already are averages.
Each average lives on its weight's device (a pipeline stage's) and is keyed by the weight's name, like the
optimizer slots; the averages and their update count are saved with the run's checkpoints (`ema/...`).

Readers: `--mode=train_and_eval` evaluates with the averages swapped in and the trained weights swapped back
after; `--mode=eval`, `decode` and `export` copy the averages of a checkpoint that holds them into the model they
restored (no flag needed: a run trained with averages is read through them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.training.optimizer_base import slot_key

__all__ = ["WeightEma", "check_decay", "maybe_use_averages", "resume"]

# The name of the averages in a trainer checkpoint (Learner.checkpointed()).
CHECKPOINT_KEY = "ema"


def check_decay(decay: float) -> None:
    """Raises ParamsError unless `decay` (train.ema_decay) is a number in [0, 1)."""
    ok = isinstance(decay, (int, float)) and not isinstance(decay, bool) and math.isfinite(decay)
    if not (ok and 0.0 <= decay < 1.0):
        raise ParamsError(f"train.ema_decay={decay!r} must be a number in [0, 1): 0 turns weight averaging off, "
                          "e.g. 0.999 averages over about the last 1000 steps")


class WeightEma(tf.Module):
    """Moving averages of `variables`, one per variable on its device; `update()` inside or outside tf.function."""

    def __init__(self, variables: Sequence[tf.Variable], decay: float) -> None:
        super().__init__(name="weight_ema")
        check_decay(decay)
        self.decay = float(decay)
        # References, not the variables: a tracked list would save the model's weights a second time, by position.
        self._refs = [var.ref() for var in variables]
        with tf.init_scope():
            # Applied updates so far; 0: the averages hold nothing yet (the first update copies the weights).
            self.updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="ema/updates")
            self.averages: dict[str, tf.Variable] = {}
            for var in self._weights():
                key = slot_key(var)
                if key in self.averages:
                    raise ValueError(f"weight EMA: two variables share the key {key!r} ({var.name!r}); give every "
                                     "variable a unique name")
                with tf.device(var.device):
                    self.averages[key] = tf.Variable(tf.zeros(var.shape, var.dtype), trainable=False,
                                                     name=f"{var.name.rsplit(':', 1)[0]}/ema")

    def _weights(self) -> list[tf.Variable]:
        return [ref.deref() for ref in self._refs]

    def average_of(self, var: tf.Variable) -> tf.Variable:
        """The moving average of `var`."""
        return self.averages[slot_key(var)]

    def update(self) -> tf.Operation | None:
        """One averaging step from the variables' current values (call it after the optimizer's update)."""
        first = tf.equal(self.updates, 0)
        ops = []
        for var in self._weights():
            average = self.average_of(var)
            with tf.device(var.device):
                decay = tf.where(first, tf.constant(0.0, var.dtype), tf.constant(self.decay, var.dtype))
                ops.append(average.assign(decay * average + (1 - decay) * var, read_value=False))
        with tf.control_dependencies(ops):
            increment = self.updates.assign_add(1, read_value=False)
        return None if tf.executing_eagerly() else tf.group(increment)

    def copy_to_model(self) -> None:
        """Overwrites the variables with their averages (eagerly); nothing to copy before the first update."""
        if int(self.updates.numpy()) == 0:
            return
        for var in self._weights():
            var.assign(self.average_of(var))

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Within the block, the variables hold their averages; after it, their trained values again."""
        weights = self._weights()
        trained = [tf.identity(v) for v in weights]
        self.copy_to_model()
        try:
            yield
        finally:
            for var, value in zip(weights, trained):
                var.assign(value)


def _holds_averages(path: str) -> bool:
    return any(name.startswith(f"{CHECKPOINT_KEY}/") for name, _ in tf.train.list_variables(path))


def _restore(ema: WeightEma, path: str) -> None:
    status = tf.train.Checkpoint(**{CHECKPOINT_KEY: ema}).restore(path)
    status.expect_partial()
    try:
        status.assert_existing_objects_matched()
    except AssertionError as e:
        raise ConfigError(f"checkpoint {path}: its weight averages do not match this model "
                          f"({' '.join(str(e).split())[:200]})") from None


def resume(ema: WeightEma, path: str, log: Callable[[str], None]) -> None:
    """A resumed training run: restores the averages of checkpoint `path`, or, when it holds none (averaging was
    off until now), says that they start from the next step's weights."""
    if _holds_averages(path):
        _restore(ema, path)
    else:
        log(f"weight averages (train.ema_decay={ema.decay}) start now: {path} holds none")


def maybe_use_averages(task: tf.Module, train_params: Params, path: str, log: Callable[[str], None],
                       ema: WeightEma | None = None) -> WeightEma | None:
    """Copies checkpoint `path`'s weight averages, when it holds them, into `task`'s trainable variables.

    For readers of a checkpoint (eval, decode, export) that restored `task` from `path`: a run trained with
    averages is read through them (as train_and_eval evaluates it), whatever the reader's own train.ema_decay.
    Pass the returned module back as `ema` to reuse it for the next checkpoint. Returns None for a checkpoint
    without averages; ConfigError when train.ema_decay > 0 asks for averages that `path` does not hold.
    """
    if not _holds_averages(path):
        if train_params.ema_decay:
            raise ConfigError(f"checkpoint {path} holds no weight averages (it was saved with train.ema_decay=0); "
                              "pass --params=train.ema_decay=0 to read its trained weights")
        return None
    if ema is None:
        ema = WeightEma(task.trainable_variables, 0.0)  # reads averages only: the decay is not used
    _restore(ema, path)
    ema.copy_to_model()
    log(f"using the weight averages ({int(ema.updates.numpy())} updates) of {path}")
    return ema
