"""Adafactor against an independent NumPy transcription of Shazeer & Stern (2018), Algorithms 4 and 5 (sums)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training.adafactor import Adafactor

RNG = np.random.default_rng(7)
STEPS = 6
LRS = np.array([0.1, 0.05, 0.2, 0.01, 0.1, 0.3])


def np_adafactor(x, grads, decay_exponent=0.8, beta1=0.0, clipping_threshold=1.0, epsilon1=1e-30, epsilon2=1e-3,
                 multiply_by_parameter_scale=True, factored=True, min_dim_size_to_factor=128):
    """The paper's update with row/column sums: R = b R + (1-b) (G^2 + e1) 1, C = b C + (1-b) 1^T (G^2 + e1),
    V = R C / (1^T R); per matrix of the last two axes."""
    x = x.copy()
    fact = factored and x.ndim >= 2 and min(x.shape[-2:]) >= min_dim_size_to_factor
    r = np.zeros(x.shape[:-1])
    c = np.zeros(x.shape[:-2] + x.shape[-1:])
    v = np.zeros_like(x)
    m = np.zeros_like(x)
    for t, (g, lr) in enumerate(zip(grads, LRS), start=1):
        b2 = 1.0 - t ** (-decay_exponent)
        g2 = g * g + epsilon1
        if fact:
            r = b2 * r + (1 - b2) * g2.sum(axis=-1)
            c = b2 * c + (1 - b2) * g2.sum(axis=-2)
            vhat = r[..., :, None] * c[..., None, :] / r.sum(axis=-1)[..., None, None]
        else:
            v = b2 * v + (1 - b2) * g2
            vhat = v
        u = g / np.sqrt(vhat)
        u = u / max(1.0, np.sqrt(np.mean(u * u)) / clipping_threshold)
        alpha = lr * (max(epsilon2, np.sqrt(np.mean(x * x))) if multiply_by_parameter_scale else 1.0)
        step = alpha * u
        if beta1 > 0:
            m = beta1 * m + (1 - beta1) * step
            step = m
        x = x - step
    return x


CASES = [
    ("matrix_factored", (4, 5), {"min_dim_size_to_factor": 2}),
    ("rank3_factored", (2, 3, 4), {"min_dim_size_to_factor": 3}),
    ("matrix_below_threshold", (4, 5), {}),
    ("matrix_unfactored", (4, 5), {"factored": False, "min_dim_size_to_factor": 1}),
    ("vector", (7,), {"min_dim_size_to_factor": 1}),
    ("momentum_clipped", (4, 5), {"min_dim_size_to_factor": 1, "beta1": 0.9, "clipping_threshold": 0.3}),
    ("absolute_step", (3, 4), {"min_dim_size_to_factor": 1, "multiply_by_parameter_scale": False,
                               "decay_exponent": 0.5, "epsilon1": 1e-3}),
]


@pytest.mark.parametrize("name,shape,overrides", CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_reference_in_tf_function(name, shape, overrides):
    x0 = RNG.normal(size=shape)
    grads = RNG.normal(size=(STEPS, *shape))
    var = tf.Variable(x0, name=f"{name}/w")
    opt = Adafactor.params().set(**overrides).instantiate()
    opt.build([var])

    @tf.function(autograph=False)
    def step(g, lr):
        opt.apply_gradients([(g, var)], lr)

    for g, lr in zip(grads, LRS):
        step(tf.constant(g), tf.constant(lr, tf.float64))
    np.testing.assert_allclose(var.numpy(), np_adafactor(x0, grads, **overrides), rtol=1e-12, atol=1e-14)


def test_factored_slots_are_row_and_column_statistics_next_to_their_variable():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:3]
    variables = []
    for k, device in enumerate(devices):
        with tf.device(device):
            variables.append(tf.Variable(tf.zeros([4, 6, 8], tf.float64), name=f"stage{k}/w"))
    with tf.device(devices[-1]):
        bias = tf.Variable(tf.zeros([8], tf.float64), name="stage_last/b")
    opt = Adafactor.params().set(min_dim_size_to_factor=2, beta1=0.5).instantiate()
    with tf.device(devices[0]):  # the default device at build time must not matter
        opt.build([*variables, bias])
    for var in variables:
        assert {name: tuple(s.shape) for name, s in opt.slots[var.name[:-2].replace("/", ".")].items()} == {
            "vr": (4, 6), "vc": (4, 8), "m": (4, 6, 8)}
        for name in ("vr", "vc", "m"):
            assert opt.get_slot(var, name).device == var.device
    assert opt.get_slot(bias, "v").shape == (8,) and opt.get_slot(bias, "v").device == bias.device
    assert len({v.device for v in variables}) == len(devices)


def test_checkpoint_restores_factored_slots_by_name(tmp_path):
    a = tf.Variable(RNG.normal(size=(3, 4)), name="ck/a")
    b = tf.Variable(RNG.normal(size=(5,)), name="ck/b")
    opt = Adafactor.params().set(min_dim_size_to_factor=1).instantiate()
    opt.build([a, b])
    for _ in range(2):
        opt.apply_gradients([(tf.ones_like(a), a), (tf.ones_like(b) * 2, b)], 0.1)
    saved = {k: {n: s.numpy().copy() for n, s in slots.items()} for k, slots in opt.slots.items()}
    path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    a2 = tf.Variable(tf.zeros([3, 4], tf.float64), name="ck/a")
    b2 = tf.Variable(tf.zeros([5], tf.float64), name="ck/b")
    opt2 = Adafactor.params().set(min_dim_size_to_factor=1).instantiate()
    opt2.build([b2, a2])  # another order: slots are found by name
    tf.train.Checkpoint(optimizer=opt2).restore(path).assert_consumed()
    for key, slots in saved.items():
        for name, value in slots.items():
            np.testing.assert_array_equal(opt2.slots[key][name].numpy(), value)
    assert int(opt2.iterations.numpy()) == 2


@pytest.mark.parametrize("field,value", [("decay_exponent", 0.0), ("beta1", 1.0), ("clipping_threshold", 0.0),
                                         ("min_dim_size_to_factor", 0), ("factored", "yes")])
def test_params_validation_names_the_field(field, value):
    with pytest.raises(ParamsError, match=f"{field}="):
        Adafactor.params().set(**{field: value}).instantiate()
