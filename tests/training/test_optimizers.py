"""Tests of gpipe_tf.training.optimizers against independent NumPy implementations."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training import optimizers

GRADS = np.array([[0.5, -1.0, 2.0],
                  [0.1, 0.3, -0.7],
                  [-1.5, 0.2, 0.05],
                  [0.9, -0.4, 1.1],
                  [0.0, 0.6, -0.3]], dtype=np.float64)
LRS = np.array([0.1, 0.05, 0.2, 0.01, 0.1], dtype=np.float64)
X0 = np.array([1.0, -2.0, 0.5], dtype=np.float64)


def np_sgd(x, momentum=0.0, nesterov=False):
    v = np.zeros_like(x)
    for g, lr in zip(GRADS, LRS):
        v = momentum * v - lr * g
        x = x + (momentum * v - lr * g if nesterov else v)
    return x


def np_adam(x, beta1=0.9, beta2=0.999, epsilon=1e-8):
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    for t, (g, lr) in enumerate(zip(GRADS, LRS), start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        lr_t = lr * np.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        x = x - lr_t * m / (np.sqrt(v) + epsilon)
    return x


def np_adamw(x, weight_decay=0.01, beta1=0.9, beta2=0.999, epsilon=1e-8, decay_exclude=""):
    """Loshchilov & Hutter's AdamW with the decay scaled by the scheduled rate (PyTorch's form)."""
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    for t, (g, lr) in enumerate(zip(GRADS, LRS), start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1 ** t)
        v_hat = v / (1 - beta2 ** t)
        # epsilon enters as in Adam above: added to sqrt(v), with the bias correction folded into the step.
        adam_step = lr * m_hat / (np.sqrt(v_hat) + epsilon / np.sqrt(1 - beta2 ** t))
        x = x - lr * weight_decay * x - adam_step
    return x


def np_rmsprop(x, decay=0.9, momentum=0.0, epsilon=1e-10, centered=False, initial_mean_square=0.0):
    ms = np.full_like(x, initial_mean_square)
    mg = np.zeros_like(x)
    mom = np.zeros_like(x)
    for g, lr in zip(GRADS, LRS):
        ms = decay * ms + (1 - decay) * g * g
        denom = ms
        if centered:
            mg = decay * mg + (1 - decay) * g
            denom = ms - mg * mg
        mom = momentum * mom + lr * g / np.sqrt(denom + epsilon)
        x = x - mom
    return x


CASES = [
    ("sgd", optimizers.SGD, {}, np_sgd),
    ("sgd_momentum", optimizers.SGD, {"momentum": 0.9}, np_sgd),
    ("sgd_nesterov", optimizers.SGD, {"momentum": 0.9, "nesterov": True}, np_sgd),
    ("adam", optimizers.Adam, {}, np_adam),
    ("adam_custom", optimizers.Adam, {"beta1": 0.8, "beta2": 0.98, "epsilon": 1e-3}, np_adam),
    ("adamw", optimizers.AdamW, {}, np_adamw),
    ("adamw_strong", optimizers.AdamW, {"weight_decay": 0.5, "beta2": 0.98}, np_adamw),
    ("adamw_excluded", optimizers.AdamW, {"weight_decay": 0.5, "decay_exclude": "adamw_excl"},
     lambda x, **kw: np_adam(x, beta2=0.999)),
    ("rmsprop", optimizers.RMSProp, {}, np_rmsprop),
    ("rmsprop_centered", optimizers.RMSProp, {"centered": True}, np_rmsprop),
    ("rmsprop_momentum_tf1", optimizers.RMSProp, {"momentum": 0.9, "initial_mean_square": 1.0}, np_rmsprop),
    ("rmsprop_centered_momentum", optimizers.RMSProp, {"centered": True, "momentum": 0.5}, np_rmsprop),
]


def make(cls, **overrides):
    p = cls.params()
    for k, v in overrides.items():
        setattr(p, k, v)
    return p.instantiate()


@pytest.mark.parametrize("name,cls,overrides,reference", CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_in_tf_function(name, cls, overrides, reference):
    var = tf.Variable(X0, name=f"{name}/w")
    frozen = tf.Variable([3.0], dtype=tf.float64, name=f"{name}/frozen")
    opt = make(cls, **overrides)
    opt.build([var, frozen])

    @tf.function(autograph=False)
    def step(g, lr):
        opt.apply_gradients([(g, var), (None, frozen)], lr)

    for g, lr in zip(GRADS, LRS):
        step(tf.constant(g), tf.constant(lr))
    np.testing.assert_allclose(var.numpy(), reference(X0, **overrides), rtol=1e-12, atol=0)
    assert frozen.numpy().tolist() == [3.0]
    assert int(opt.iterations.numpy()) == len(GRADS)


def test_eager_apply_and_python_float_lr():
    var = tf.Variable(X0, name="eager/w")
    opt = make(optimizers.SGD, momentum=0.9)
    opt.build([var])
    for g, lr in zip(GRADS, LRS):
        assert opt.apply_gradients([(tf.constant(g), var)], float(lr)) is None
    np.testing.assert_allclose(var.numpy(), np_sgd(X0, momentum=0.9), rtol=1e-12, atol=0)


def test_slots_colocated_named_and_non_trainable():
    with tf.device("/CPU:0"):
        var = tf.Variable(np.zeros((2, 3)), name="classifier/fc_0/w")
    opt = make(optimizers.Adam)
    opt.build([var])
    for slot_name in ("m", "v"):
        slot = opt.get_slot(var, slot_name)
        assert slot.device == var.device
        assert slot.name == f"classifier/fc_0/w/{slot_name}:0"
        assert slot.dtype == tf.float64 and slot.shape == var.shape
        assert not slot.trainable
        assert not slot.numpy().any()
    assert optimizers.slot_key(var) == "classifier.fc_0.w"
    assert opt.trainable_variables == ()


def test_rmsprop_initial_mean_square_and_optional_slots():
    var = tf.Variable(X0, name="rms/w")
    opt = make(optimizers.RMSProp, initial_mean_square=1.0)
    opt.build([var])
    assert sorted(opt.slots[optimizers.slot_key(var)]) == ["ms"]
    np.testing.assert_array_equal(opt.get_slot(var, "ms").numpy(), np.ones(3))
    opt2 = make(optimizers.RMSProp, centered=True, momentum=0.9)
    opt2.build([var])
    assert sorted(opt2.slots[optimizers.slot_key(var)]) == ["mg", "mom", "ms"]


def test_build_is_idempotent_and_extends():
    a = tf.Variable(X0, name="build/a")
    b = tf.Variable([1.0], name="build/b")
    opt = make(optimizers.Adam)
    opt.build([a])
    slot = opt.get_slot(a, "m")
    opt.build([a])
    assert opt.get_slot(a, "m") is slot and len(opt.variables) == 3  # iterations, m, v
    opt.build([a, b])
    assert len(opt.variables) == 5


def test_clashing_names_rejected():
    a = tf.Variable(1.0, name="clash/x")
    b = tf.Variable(2.0, name="clash/x")
    opt = make(optimizers.SGD, momentum=0.5)
    with pytest.raises(ValueError, match="unique name"):
        opt.build([a, b])


def test_missing_build_names_variable():
    var = tf.Variable(X0, name="unbuilt/w")
    opt = make(optimizers.SGD)
    with pytest.raises(ValueError, match=r"unbuilt/w.*call optimizer.build\(variables\) before the first step"):
        opt.apply_gradients([(tf.constant(GRADS[0]), var)], 0.1)


def test_checkpoint_round_trip(tmp_path):
    var = tf.Variable(X0, name="ckpt/w")
    opt = make(optimizers.Adam)
    opt.build([var])
    for g in GRADS[:2]:
        opt.apply_gradients([(tf.constant(g), var)], 0.1)
    saved = [v.numpy().copy() for v in (var, opt.get_slot(var, "m"), opt.get_slot(var, "v"))]
    path = tf.train.Checkpoint(optimizer=opt, var=var).save(str(tmp_path / "ckpt"))
    for g in GRADS[2:]:
        opt.apply_gradients([(tf.constant(g), var)], 0.1)
    assert not np.array_equal(var.numpy(), saved[0])

    tf.train.Checkpoint(optimizer=opt, var=var).restore(path).assert_consumed()
    for v, want in zip((var, opt.get_slot(var, "m"), opt.get_slot(var, "v")), saved):
        np.testing.assert_array_equal(v.numpy(), want)
    assert int(opt.iterations.numpy()) == 2

    # A fresh optimizer built over a same-named variable finds its slots by name.
    var2 = tf.Variable(np.zeros(3), name="ckpt/w")
    opt2 = make(optimizers.Adam)
    opt2.build([var2])
    tf.train.Checkpoint(optimizer=opt2, var=var2).restore(path).assert_consumed()
    np.testing.assert_array_equal(opt2.get_slot(var2, "v").numpy(), saved[2])
    assert int(opt2.iterations.numpy()) == 2


def test_params_validation():
    with pytest.raises(ParamsError, match=r"momentum=1\.5"):
        make(optimizers.SGD, momentum=1.5)
    with pytest.raises(ParamsError, match="beta2"):
        make(optimizers.Adam, beta2=1.0)
    with pytest.raises(ParamsError, match="epsilon"):
        make(optimizers.RMSProp, epsilon=-1.0)
    assert make(optimizers.RMSProp).p.name == "rmsprop"


def test_clip_by_global_norm_matches_numpy():
    g1 = np.array([3.0, -4.0], dtype=np.float64)
    g2 = np.array([[1.0, 2.0], [-2.0, 0.5]], dtype=np.float32)
    want_norm = np.sqrt((g1 ** 2).sum() + (g2.astype(np.float64) ** 2).sum())
    grads = [tf.constant(g1), None, tf.constant(g2)]

    clipped, norm = optimizers.clip_by_global_norm(grads, 2.0)
    assert norm.dtype == tf.float32
    np.testing.assert_allclose(norm.numpy(), want_norm, rtol=1e-6)
    assert clipped[1] is None
    np.testing.assert_allclose(clipped[0].numpy(), g1 * 2.0 / want_norm, rtol=1e-12)
    np.testing.assert_allclose(clipped[2].numpy(), g2 * 2.0 / want_norm, rtol=1e-6)
    assert clipped[2].dtype == tf.float32

    for clip_norm in (100.0, 0.0):
        unclipped, norm = optimizers.clip_by_global_norm(grads, clip_norm)
        np.testing.assert_allclose(norm.numpy(), want_norm, rtol=1e-6)
        np.testing.assert_array_equal(unclipped[0].numpy(), g1)
        np.testing.assert_array_equal(unclipped[2].numpy(), g2)
        assert unclipped[1] is None


def test_clip_by_global_norm_indexed_slices_and_empty():
    # Duplicate index 0: the dense gradient is [2, 0, 0], norm 2 (not sqrt(2) from the raw values).
    slices = tf.IndexedSlices(tf.constant([1.0, 1.0]), tf.constant([0, 0]), tf.constant([3]))
    _, norm = optimizers.clip_by_global_norm([slices], 1.0)
    np.testing.assert_allclose(norm.numpy(), 2.0, rtol=1e-7)
    clipped, norm = optimizers.clip_by_global_norm([None], 1.0)
    assert clipped == [None] and float(norm.numpy()) == 0.0


def test_clip_by_global_norm_non_finite_norm_gives_nan():
    clipped, norm = optimizers.clip_by_global_norm([tf.constant([np.inf, 1.0]), tf.constant([2.0])], 1.0)
    assert np.isinf(norm.numpy())
    assert all(np.isnan(g.numpy()).all() for g in clipped)


def test_adamw_params_validation():
    with pytest.raises(ParamsError, match=r"weight_decay=-0\.1"):
        make(optimizers.AdamW, weight_decay=-0.1)
    with pytest.raises(ParamsError, match=r"decay_exclude='\(bias'"):
        make(optimizers.AdamW, decay_exclude="(bias")


def test_an_optimizer_is_chosen_with_its_own_fields_from_the_command_line_form():
    from gpipe_tf import experiment
    from gpipe_tf.training.adafactor import Adafactor
    from gpipe_tf.training.optimizers import AdamW

    params, _ = experiment.resolve_params("toy.classifier.BlobsMlp", overrides=(
        "train.optimizer.cls=gpipe_tf.training.optimizers.AdamW,train.optimizer.weight_decay=0.05"))
    assert params.train.optimizer.cls is AdamW and params.train.optimizer.weight_decay == 0.05
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlp", overrides=(
        "train.optimizer=gpipe_tf.training.adafactor.Adafactor,train.optimizer.beta1=0.9"))
    assert params.train.optimizer.cls is Adafactor and params.train.optimizer.beta1 == 0.9
