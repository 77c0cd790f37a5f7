"""Splitting a batch (any nested structure of tensors) into M micro-batches and merging outputs back."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import ParamsError


def batch_size(structure: Any) -> int:
    """The static leading dimension shared by every tensor of `structure`."""
    sizes = {int(t.shape[0]) for t in tf.nest.flatten(structure) if t.shape.rank and t.shape[0] is not None}
    if len(sizes) != 1:
        raise ParamsError(f"every input of a pipeline needs the same static batch dimension, got {sorted(sizes)}")
    return sizes.pop()


def valid_micro_batch_counts(size: int) -> list[int]:
    """The M that divide a batch of `size`."""
    return [m for m in range(1, size + 1) if size % m == 0]


def check_divisible(structure: Any, num_micro_batches: int) -> int:
    """Returns the batch size; a size that M does not divide is an error naming the valid M."""
    size = batch_size(structure)
    if size % num_micro_batches:
        raise ParamsError(f"batch size {size} is not divisible by num_micro_batches={num_micro_batches}; valid "
                          f"values: {valid_micro_batch_counts(size)}")
    return size


def split_list(structure: Any, num_micro_batches: int) -> list[Any]:
    """M structures, micro-batch i holding rows [i*B/M, (i+1)*B/M) of every tensor."""
    check_divisible(structure, num_micro_batches)
    parts = [tf.split(t, num_micro_batches, axis=0) for t in tf.nest.flatten(structure)]
    return [tf.nest.pack_sequence_as(structure, [p[i] for p in parts]) for i in range(num_micro_batches)]


def split(structure: Any, num_micro_batches: int) -> Any:
    """Reshapes every tensor [B, ...] to [M, B/M, ...]; the loop then reads micro-batch i with t[i]."""
    if not tf.nest.flatten(structure):
        return structure  # e.g. a loss without targets
    size = check_divisible(structure, num_micro_batches)
    m = num_micro_batches
    return tf.nest.map_structure(lambda t: tf.reshape(t, tf.concat([[m, size // m], tf.shape(t)[1:]], 0)),
                                 structure)


def merge(stacked: tf.Tensor) -> tf.Tensor:
    """[M, B/M, ...] back to [B, ...]."""
    shape = tf.shape(stacked)
    return tf.reshape(stacked, tf.concat([[shape[0] * shape[1]], shape[2:]], 0))
