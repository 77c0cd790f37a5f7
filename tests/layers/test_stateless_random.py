"""`stateless_random`: the same seeds and uniforms with and without XLA, and uniforms that are uniform."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.layers import stateless_random


def draws(seed, shape, dtype):
    a = stateless_random.fold_in(seed, 3)
    b = stateless_random.fold_in(a, 987654321)  # a large seed: where TensorFlow's own fold_in differs under XLA
    c = stateless_random.fold_in(b, tf.constant(7))
    return a, b, c, stateless_random.uniform(shape, c, dtype)


@pytest.mark.parametrize("shape,dtype", [([12], tf.float32), ([300, 7], tf.float64), ([2, 3, 5], tf.float32)])
def test_seeds_and_uniforms_are_the_same_with_and_without_xla(shape, dtype):
    seed = tf.constant([5, -6], tf.int64)
    plain = tf.function(draws, autograph=False)(seed, shape, dtype)
    compiled = tf.function(draws, jit_compile=True, autograph=False)(seed, shape, dtype)
    for a, b in zip(plain, compiled):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert plain[-1].dtype == dtype and plain[-1].shape == shape


def test_uniforms_are_uniform_on_the_unit_interval():
    u = stateless_random.uniform([200_000], tf.constant([1, 2], tf.int64)).numpy()
    assert u.min() >= 0.0 and u.max() < 1.0
    assert np.all(u * 2 ** 24 == np.floor(u * 2 ** 24))  # multiples of 2**-24: exact in float32
    # Mean 1/2 and variance 1/12, within 5 standard errors of 200,000 draws.
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
    assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / u.size)
    counts, _ = np.histogram(u, bins=10, range=(0, 1))
    assert np.all(np.abs(counts - u.size / 10) < 5 * np.sqrt(u.size / 10))


def test_different_seeds_and_data_give_different_draws():
    seed = tf.constant([1, 2], tf.int64)
    folded = [stateless_random.fold_in(seed, d).numpy().tolist() for d in range(4)]
    assert len({tuple(f) for f in folded}) == 4
    a = stateless_random.uniform([64], seed).numpy()
    b = stateless_random.uniform([64], tf.constant([1, 3], tf.int64)).numpy()
    c = stateless_random.uniform([64], tf.constant([2, 2], tf.int64)).numpy()
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    np.testing.assert_array_equal(a, stateless_random.uniform([64], seed).numpy())
