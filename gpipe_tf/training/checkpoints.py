"""Checkpoints of a training run: task variables, optimizer slots, global step and input position."""

from __future__ import annotations

import os

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.training.logdir import CHECKPOINT_DIR


def checkpoint_dir(logdir: str) -> str:
    """Where the trainer's checkpoints live."""
    return os.path.join(logdir, CHECKPOINT_DIR)


def make_manager(checkpoint: tf.train.Checkpoint, logdir: str, max_to_keep: int) -> tf.train.CheckpointManager:
    """A CheckpointManager over logdir/checkpoints."""
    return tf.train.CheckpointManager(checkpoint, checkpoint_dir(logdir), max_to_keep=max_to_keep)


def restore_latest(checkpoint: tf.train.Checkpoint, logdir: str, partial: bool = False) -> str | None:
    """Restores the latest checkpoint if there is one; returns its path (None: fresh start).

    `partial` allows objects of the checkpoint to be left unread (an evaluator reads the model only).
    A checkpoint that does not match the model (other shapes) raises ConfigError.
    """
    path = tf.train.latest_checkpoint(checkpoint_dir(logdir))
    if path is None:
        return None
    try:
        status = checkpoint.restore(path)
        if partial:
            status.expect_partial()
        else:
            status.assert_existing_objects_matched()
    except (ValueError, AssertionError, tf.errors.InvalidArgumentError) as e:
        raise ConfigError(f"checkpoint {path} does not match this model ({' '.join(str(e).split())[:300]}); "
                          "use a new --logdir") from None
    return path
