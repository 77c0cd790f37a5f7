"""Stateless random numbers that are the same with and without XLA.

TensorFlow's stateless ops give other values under XLA than its kernels for the same seed (TF 2.21, XLA:CPU):
`tf.random.stateless_uniform` in floating point (up to 0.86 apart), and every op that turns a seed into Philox's key
and counter once the seed is large (`stateless_fold_in` of its own output, for one). Philox's 32- and 64-bit
integers from an explicit key and counter agree bit for bit. So here the key and counter are the seed's own bits,
and floats are made from the integers with exact operations: a dropout mask drawn in an XLA stage cell equals the
one drawn without XLA, and a recompute draws its forward's mask either way (`tests/layers/test_stateless_random.py`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

_PHILOX = 1  # TensorFlow's algorithm id for Philox (tf.random.Algorithm.PHILOX)
_MANTISSA_BITS = 24  # a float32 holds every multiple of 2**-24 in [0, 1) exactly


def _key_counter(seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Philox's key and counter from an int seed of shape [2]: the first element's bits are the key, the second's
    the counter's high word (each draw counts up from zero in the low word)."""
    bits = tf.bitcast(tf.cast(seed, tf.int64), tf.uint64)
    return bits[:1], tf.stack([tf.zeros([], tf.uint64), bits[1]])


def _integers(shape: Any, seed: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    key, counter = _key_counter(seed)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(shape=shape, key=key, counter=counter, alg=_PHILOX, dtype=dtype)


def fold_in(seed: tf.Tensor, data: Any) -> tf.Tensor:
    """A new int64 seed of shape [2] from `seed` and the integer `data` (a step, a micro-batch index, a layer id):
    a draw from `seed`, and `data` itself, so that different data never give the same seed."""
    return tf.stack([_integers([1], seed, tf.int64)[0], tf.cast(data, tf.int64)])


def uniform(shape: Any, seed: tf.Tensor, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """Floats in [0, 1), multiples of 2**-24, of `shape` and `dtype` (float32 or wider), from the stateless `seed`
    (an int tensor of shape [2])."""
    top = tf.bitwise.right_shift(_integers(shape, seed, tf.uint32), tf.constant(32 - _MANTISSA_BITS, tf.uint32))
    return tf.cast(tf.cast(top, tf.float32) * (2.0 ** -_MANTISSA_BITS), dtype)
