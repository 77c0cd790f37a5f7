"""Checkpoints of a training run: task variables, optimizer slots, global step and input position."""

from __future__ import annotations

import os
from typing import Callable

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.training.logdir import CHECKPOINT_DIR


def checkpoint_dir(logdir: str) -> str:
    """Where the trainer's checkpoints live."""
    return os.path.join(logdir, CHECKPOINT_DIR)


def make_manager(checkpoint: tf.train.Checkpoint, logdir: str, max_to_keep: int) -> tf.train.CheckpointManager:
    """A CheckpointManager over logdir/checkpoints."""
    return tf.train.CheckpointManager(checkpoint, checkpoint_dir(logdir), max_to_keep=max_to_keep)


def checkpoint_paths(logdir: str) -> list[str]:
    """Every checkpoint the manager lists, oldest first."""
    state = tf.train.get_checkpoint_state(checkpoint_dir(logdir))
    return list(state.all_model_checkpoint_paths) if state else []


def step_of(path: str) -> int:
    """The global step in a checkpoint path `.../ckpt-N`."""
    return int(path.rsplit("-", 1)[1])


def restore_latest(checkpoint: tf.train.Checkpoint, logdir: str, partial: bool = False,
                   warn: Callable[[str], None] = print) -> str | None:
    """Restores the newest readable checkpoint; returns its path (None: fresh start).

    A corrupt or partial newest checkpoint (a crash or a full disk while it was written) is skipped with a warning
    and the previous one is used. `partial` allows objects of the checkpoint to be left unread (an evaluator reads
    the model only). A checkpoint of another model (other shapes) raises ConfigError.
    """
    paths = checkpoint_paths(logdir)
    for path in reversed(paths):
        try:
            restore(checkpoint, path, partial)
            return path
        except _CORRUPT as e:
            warn(f"warning: checkpoint {path} is unreadable ({_short(e)}); trying the previous one")
    if paths:
        raise ConfigError(f"no readable checkpoint in {checkpoint_dir(logdir)}; use a new --logdir")
    return None


# A truncated file surfaces as DataLossError from the kernels, or IndexError from the Python reader.
_CORRUPT = (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError, IndexError)


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


def restore(checkpoint: tf.train.Checkpoint, path: str, partial: bool = False) -> None:
    """Restores `path` into `checkpoint`; a checkpoint of another model raises ConfigError."""
    try:
        status = checkpoint.restore(path)
        if partial:
            status.expect_partial()
        else:
            status.assert_existing_objects_matched()
    except _CORRUPT:
        raise
    except (ValueError, AssertionError, tf.errors.InvalidArgumentError) as e:
        raise ConfigError(f"checkpoint {path} does not match this model ({_short(e)}); use a new --logdir") from None
