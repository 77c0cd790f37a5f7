"""Layers against NumPy references, deterministic initialization, and dtype/seed inheritance."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.activations import Activation
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.embedding import Embedding
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.normalization import LayerNorm
from gpipe_tf.layers.sequential import Sequential
from gpipe_tf.layers.softmax import SoftmaxCrossEntropy

RNG = np.random.default_rng(0)


def test_linear_matches_numpy_on_2d_and_3d_inputs():
    layer = Linear.params().set(input_dim=3, output_dim=4, activation="relu", dtype="float64").instantiate()
    w, b = layer.vars["w"].numpy(), layer.vars["b"].numpy()
    layer.vars["b"].assign(RNG.normal(size=4))
    b = layer.vars["b"].numpy()
    for shape in [(5, 3), (2, 5, 3)]:
        x = RNG.normal(size=shape)
        np.testing.assert_allclose(layer(tf.constant(x)).numpy(), np.maximum(x @ w + b, 0), rtol=1e-12)
    assert Linear.num_params(layer.p) == sum(int(np.prod(v.shape)) for v in layer.trainable_variables)


def test_initialization_is_deterministic_and_seed_dependent():
    p = Linear.params().set(input_dim=8, output_dim=8)
    a, b = p.instantiate(), p.instantiate()
    np.testing.assert_array_equal(a.vars["w"].numpy(), b.vars["w"].numpy())
    c = p.copy().set(seed=99).instantiate()
    assert not np.allclose(a.vars["w"].numpy(), c.vars["w"].numpy())
    limit = np.sqrt(6.0 / 16)
    assert np.abs(a.vars["w"].numpy()).max() <= limit


def test_dtype_and_seed_flow_down_to_children():
    layers = [Linear.params().set(input_dim=2, output_dim=2), Linear.params().set(input_dim=2, output_dim=2)]
    seq = Sequential.params().set(dtype="float64", layers=layers).instantiate()
    children = list(seq.children.values())
    assert all(v.dtype == tf.float64 for v in seq.trainable_variables)
    assert children[0].p.seed != children[1].p.seed
    assert not np.allclose(children[0].vars["w"].numpy(), children[1].vars["w"].numpy())
    assert children[0].vars["w"].name.startswith("sequential/layer_0/w")
    x = RNG.normal(size=(3, 2))
    ref = x
    for child in children:
        ref = ref @ child.vars["w"].numpy() + child.vars["b"].numpy()
    np.testing.assert_allclose(seq(tf.constant(x)).numpy(), ref, rtol=1e-12)


def test_layer_norm_matches_numpy():
    layer = LayerNorm.params().set(dim=6, dtype="float64").instantiate()
    layer.vars["scale"].assign(RNG.normal(size=6))
    layer.vars["bias"].assign(RNG.normal(size=6))
    x = RNG.normal(size=(4, 6)) * 3 + 1
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    ref = (x - mean) / np.sqrt(var + 1e-6) * layer.vars["scale"].numpy() + layer.vars["bias"].numpy()
    np.testing.assert_allclose(layer(tf.constant(x)).numpy(), ref, rtol=1e-10)


@pytest.mark.parametrize("name,ref", [("relu", lambda x: np.maximum(x, 0)), ("tanh", np.tanh),
                                      ("sigmoid", lambda x: 1 / (1 + np.exp(-x))), ("none", lambda x: x)])
def test_activation_matches_numpy(name, ref):
    x = RNG.normal(size=(3, 4))
    out = Activation.params().set(activation=name).instantiate()(tf.constant(x))
    np.testing.assert_allclose(out.numpy(), ref(x), rtol=1e-12)


def test_unknown_activation_lists_choices():
    with pytest.raises(ParamsError, match="unknown activation 'rleu'.*relu"):
        Activation.params().set(activation="rleu").instantiate()


def test_dropout_is_stateless_and_reproducible():
    layer = Dropout.params().set(rate=0.3).instantiate()
    x = tf.ones([200, 50])
    ctx = FPropContext(training=True, seed=tf.constant([3, 4], tf.int64))
    a, b = layer(x, ctx).numpy(), layer(x, ctx).numpy()
    np.testing.assert_array_equal(a, b)
    assert set(np.unique(a)).issubset({0.0, np.float32(1 / 0.7)})
    assert abs((a == 0).mean() - 0.3) < 0.02
    other = layer(x, FPropContext(training=True, seed=tf.constant([3, 5], tf.int64))).numpy()
    assert (a != other).any()
    np.testing.assert_array_equal(layer(x, FPropContext(training=False)).numpy(), x.numpy())
    with pytest.raises(ValueError, match="seed is None"):
        layer(x, FPropContext(training=True))


def test_dropout_masks_differ_between_layers_with_one_seed():
    a = Dropout.params().set(name="a", rate=0.5).instantiate()
    b = Dropout.params().set(name="b", rate=0.5).instantiate()
    ctx = FPropContext(training=True, seed=tf.constant([1, 1], tf.int64))
    x = tf.ones([100])
    assert (a(x, ctx).numpy() != b(x, ctx).numpy()).any()


def test_embedding_lookup_and_scaling():
    layer = Embedding.params().set(vocab_size=10, embedding_dim=4, scale_sqrt_depth=True).instantiate()
    ids = np.array([[1, 2], [9, 0]])
    ref = layer.vars["emb"].numpy()[ids] * 2.0
    np.testing.assert_allclose(layer(tf.constant(ids)).numpy(), ref, rtol=1e-6)


def test_softmax_xent_with_label_smoothing_matches_numpy():
    layer = SoftmaxCrossEntropy.params().set(input_dim=3, num_classes=5, label_smoothing=0.1,
                                             dtype="float64").instantiate()
    x = RNG.normal(size=(4, 3))
    labels = np.array([0, 4, 2, 2])
    logits = layer(tf.constant(x)).numpy()
    np.testing.assert_allclose(logits, x @ layer.vars["w"].numpy() + layer.vars["b"].numpy(), rtol=1e-12)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = np.eye(5)[labels] * 0.9 + 0.1 / 5
    ref = -(targets * log_probs).sum(-1)
    np.testing.assert_allclose(layer.xent(tf.constant(logits), tf.constant(labels)).numpy(), ref, rtol=1e-12)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_xent_of_sequence_logits_and_its_gradient_match_the_dense_targets(smoothing):
    """[B, T, V] logits: the loss is -sum t log_softmax(z) and its gradient softmax(z) - t, t the smoothed one-hot
    targets (NumPy), although no dense targets are made."""
    from gpipe_tf.layers.softmax import smoothed_xent
    z = RNG.normal(size=(2, 3, 7))
    labels = np.array([[0, 6, 3], [3, 1, 0]])
    targets = np.eye(7)[labels] * (1 - smoothing) + smoothing / 7
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    logits = tf.constant(z)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = smoothed_xent(logits, tf.constant(labels), smoothing)
        total = tf.reduce_sum(loss)
    np.testing.assert_allclose(loss.numpy(), -(targets * np.log(probs)).sum(-1), rtol=1e-12)
    np.testing.assert_allclose(tape.gradient(total, logits).numpy(), probs - targets, atol=1e-12)


def test_bad_layer_params_name_the_field():
    with pytest.raises(ParamsError, match="input_dim and output_dim must be > 0"):
        Linear.params().instantiate()
    with pytest.raises(ParamsError, match="rate=1.5"):
        Dropout.params().set(rate=1.5).instantiate()
    with pytest.raises(ParamsError, match="dtype='int8'"):
        Linear.params().set(input_dim=1, output_dim=1, dtype="int8").instantiate()


@pytest.mark.parametrize("smoothing,compute,expected_per_logit", [
    (0.0, "float32", 3 * 4),  # the logits, the fused op's gradient, the logits' gradient
    (0.1, "float32", 4 * 4),  # and the smoothed targets
    (0.0, "bfloat16", 3 * 4 + 2),  # the loss in float32, and the projection's bfloat16 output
])
def test_the_loss_heads_planned_bytes_count_the_tensors_its_cross_entropy_keeps(smoothing, compute,
                                                                                 expected_per_logit):
    p = SoftmaxCrossEntropy.params().set(name="sm", input_dim=16, num_classes=7, label_smoothing=smoothing)
    logits = 2 * 5 * 7
    assert SoftmaxCrossEntropy.loss_bytes(p, tf.TensorSpec([2, 5, 16], compute)) == logits * expected_per_logit


def test_xent_of_a_label_outside_the_classes_is_zero_with_zero_gradient():
    """An "ignore" label (-1) or one past the classes has all-zero one-hot targets: loss 0, gradient 0."""
    from gpipe_tf.layers.softmax import smoothed_xent
    logits = tf.constant(RNG.normal(size=(3, 5)))
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = smoothed_xent(logits, tf.constant([-1, 2, 5]), 0.0)
        total = tf.reduce_sum(loss)
    grad = tape.gradient(total, logits).numpy()
    assert loss.numpy()[0] == 0.0 and loss.numpy()[2] == 0.0 and loss.numpy()[1] > 0
    np.testing.assert_array_equal(grad[[0, 2]], 0.0)
    assert np.all(np.isfinite(grad)) and np.any(grad[1] != 0)
