"""Weight initializers described by Params, with deterministic stateless seeds.

A layer's variables get the same initial values on every run and every device placement: each variable's seed
is derived from the layer's seed and the variable's name, never from global random state.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import tensorflow as tf

from gpipe_tf.hyperparams import Params, ParamsError

METHODS = ("xavier", "gaussian", "uniform", "truncated_gaussian", "he_gaussian", "constant")


def weight_init(method: str = "xavier", scale: float = 1.0) -> Params:
    """Returns Params describing an initializer.

    Methods: xavier (Glorot uniform times scale), gaussian (stddev=scale), uniform ([-scale, scale]),
    truncated_gaussian (stddev=scale, cut at 2 stddev), he_gaussian (stddev=scale*sqrt(2/fan_in)),
    constant (every element = scale).
    """
    p = Params()
    p.define("method", method, f"Initializer: one of {', '.join(METHODS)}.")
    p.define("scale", scale, "Scale: gain for xavier/he, stddev, half-range or the constant value.")
    return p


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from any printable parts (unlike hash(), it does not change between processes)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode("utf-8")) & 0x7FFFFFFF


def _fans(shape: Sequence[int]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return shape[-2] * receptive, shape[-1] * receptive


def initial_value(init: Params, shape: Sequence[int], dtype: tf.DType, seed: int) -> tf.Tensor:
    """Computes the initial value of a variable of `shape` from initializer Params and an integer seed."""
    shape = [int(d) for d in shape]
    pair = tf.constant([seed, 0], dtype=tf.int64)
    method, scale = init.method, float(init.scale)
    fan_in, fan_out = _fans(shape)
    # Draw in float64 and cast, so float32 and float64 copies of a model start from the same values.
    if method == "xavier":
        limit = scale * math.sqrt(6.0 / (fan_in + fan_out))
        value = tf.random.stateless_uniform(shape, pair, -limit, limit, dtype=tf.float64)
    elif method == "gaussian":
        value = tf.random.stateless_normal(shape, pair, stddev=scale, dtype=tf.float64)
    elif method == "uniform":
        value = tf.random.stateless_uniform(shape, pair, -scale, scale, dtype=tf.float64)
    elif method == "truncated_gaussian":
        value = tf.random.stateless_truncated_normal(shape, pair, stddev=scale, dtype=tf.float64)
    elif method == "he_gaussian":
        value = tf.random.stateless_normal(shape, pair, stddev=scale * math.sqrt(2.0 / fan_in),
                                           dtype=tf.float64)
    elif method == "constant":
        value = tf.fill(shape, tf.constant(scale, tf.float64))
    else:
        raise ParamsError(f"unknown initializer method {method!r}; expected one of {', '.join(METHODS)}")
    return tf.cast(value, dtype)
