"""Attention, feed-forward and Transformer encoder layers against NumPy references, and their Params-only costs."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.attention import FeedForward, MultiHeadAttention, causal_bias, large_negative_number, padding_bias
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.sequential import Sequential
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from tests.helpers.np_reference import np_attention, np_layer_norm, np_linear, num_variable_elements, randomize

RNG = np.random.default_rng(0)
EVAL = FPropContext(training=False)
PADDINGS = np.array([[0.0, 0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 1.0]])

# ------------------------------------------------------------------------------------------ NumPy references


def np_ffn(x, t, act):
    return np_linear(act(np_linear(x, t["fc1"])), t["fc2"])


def np_encoder(x, paddings, t, p):
    masked = None if paddings is None else (paddings > 0)[:, None, None, :]

    def attn(h):
        return np_attention(t["self_atten"], h, h, masked, p.num_heads)[0]

    def ffn(h):
        return np_ffn(h, t["ffn"], lambda a: np.maximum(a, 0))

    eps = p.ln_epsilon
    if p.pre_norm:
        y = x + attn(np_layer_norm(x, t["atten_ln"], eps))
        return y + ffn(np_layer_norm(y, t["ffn_ln"], eps))
    y = np_layer_norm(x + attn(x), t["atten_ln"], eps)
    return np_layer_norm(y + ffn(y), t["ffn_ln"], eps)


def encoder_params(pre_norm=True, **kwargs):
    return TransformerEncoderLayer.params().set(model_dim=8, num_heads=2, hidden_dim=12, pre_norm=pre_norm,
                                                dtype="float64", **kwargs)


# ------------------------------------------------------------------------------------------------- biases


def test_padding_and_causal_biases():
    bias = padding_bias(tf.constant([[0.0, 0.0, 1.0]], tf.float64)).numpy()
    np.testing.assert_array_equal(bias, [[[[0.0, 0.0, -1e9]]]])
    causal = causal_bias(3, tf.float64).numpy()
    assert causal.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(causal[0, 0], np.triu(np.full((3, 3), -1e9), k=1))
    assert causal_bias(tf.constant(2), "float32").dtype == tf.float32
    # Two masks summed must stay finite in float16, or a fully masked row would turn into NaN.
    assert np.isfinite(np.float16(2 * large_negative_number(tf.float16)))
    with pytest.raises(TypeError, match="float"):
        padding_bias(tf.constant([[0, 1]]))


# ---------------------------------------------------------------------------------------------- attention


def test_attention_with_padding_mask_matches_numpy_and_ignores_padded_keys():
    layer = MultiHeadAttention.params().set(model_dim=8, num_heads=2, dtype="float64").instantiate()
    t = randomize(layer, RNG)
    query, memory = RNG.normal(size=(2, 3, 8)), RNG.normal(size=(2, 5, 8))
    bias = padding_bias(tf.constant(PADDINGS))
    out, probs = layer.compute_attention(layer.theta, tf.constant(query), tf.constant(memory), bias, EVAL)
    masked = (PADDINGS > 0)[:, None, None, :]
    ref, ref_probs = np_attention(t, query, memory, masked, 2)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10)
    np.testing.assert_allclose(probs.numpy(), ref_probs, rtol=1e-10)
    assert probs.shape == (2, 2, 3, 5)
    assert np.all(probs.numpy()[np.broadcast_to(masked, probs.shape)] == 0.0)
    np.testing.assert_array_equal(layer((tf.constant(query), tf.constant(memory), bias)).numpy(), out.numpy())
    # Garbage in padded memory rows must not leak into the output at all.
    noisy = memory + 1e3 * PADDINGS[:, :, None] * RNG.normal(size=memory.shape)
    np.testing.assert_array_equal(layer((tf.constant(query), tf.constant(noisy), bias)).numpy(), out.numpy())


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_attention_with_causal_mask_gives_future_keys_zero_weight(dtype):
    layer = MultiHeadAttention.params().set(model_dim=6, num_heads=2, head_dim=3 if dtype == "float64" else 5,
                                            has_bias=dtype == "float32", dtype=dtype).instantiate()
    t = randomize(layer, RNG)
    x = RNG.normal(size=(2, 4, 6))
    bias = causal_bias(4, dtype) + padding_bias(tf.constant(PADDINGS[:, 1:], dtype))
    out, probs = layer.compute_attention(layer.theta, tf.constant(x, dtype), tf.constant(x, dtype), bias, EVAL)
    masked = np.triu(np.ones((4, 4), bool), k=1)[None, None] | (PADDINGS[:, 1:] > 0)[:, None, None, :]
    ref, ref_probs = np_attention(t, x, x, masked, 2)
    rtol = 1e-10 if dtype == "float64" else 1e-4
    np.testing.assert_allclose(out.numpy(), ref, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(probs.numpy(), ref_probs, rtol=rtol, atol=rtol)
    assert np.all(probs.numpy()[np.broadcast_to(masked, probs.shape)] == 0.0)
    # memory None is self-attention.
    np.testing.assert_array_equal(layer((tf.constant(x, dtype), None, bias)).numpy(), out.numpy())


def test_attention_in_float16_stays_finite_when_every_key_is_masked():
    layer = MultiHeadAttention.params().set(model_dim=4, num_heads=2, dtype="float16").instantiate()
    x = tf.constant(RNG.normal(size=(2, 3, 4)), tf.float16)
    paddings = tf.constant([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]], tf.float16)
    bias = padding_bias(paddings) + causal_bias(3, tf.float16)
    out = layer((x, x, bias))
    assert out.dtype == tf.float16 and np.all(np.isfinite(out.numpy()))


# ------------------------------------------------------------------------------------------- feed-forward


@pytest.mark.parametrize("activation,fn", [("relu", lambda a: np.maximum(a, 0)), ("tanh", np.tanh)])
def test_feed_forward_matches_numpy(activation, fn):
    layer = FeedForward.params().set(model_dim=4, hidden_dim=7, activation=activation, dropout_rate=0.5,
                                     dtype="float64").instantiate()
    t = randomize(layer, RNG)
    x = RNG.normal(size=(2, 3, 4))
    np.testing.assert_allclose(layer(tf.constant(x)).numpy(), np_ffn(x, t, fn), rtol=1e-10)


# ---------------------------------------------------------------------------------------------- encoder


@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("kind", ["tensor", "tuple", "list"])
def test_encoder_layer_matches_numpy(pre_norm, kind):
    layer = encoder_params(pre_norm, ln_epsilon=1e-3).instantiate()
    t = randomize(layer, RNG)
    x = RNG.normal(size=(2, 5, 8))
    if kind == "tensor":
        out = layer(tf.constant(x))
        assert isinstance(out, tf.Tensor)
        np.testing.assert_allclose(out.numpy(), np_encoder(x, None, t, layer.p), rtol=1e-10)
        return
    paddings = tf.constant(PADDINGS)
    inputs = (tf.constant(x), paddings) if kind == "tuple" else [tf.constant(x), paddings]
    out = layer(inputs)
    assert type(out) is type(inputs) and len(out) == 2
    assert out[1] is paddings
    np.testing.assert_allclose(out[0].numpy(), np_encoder(x, PADDINGS, t, layer.p), rtol=1e-10)
    # The mask matters: without it the padded keys would be attended to.
    assert not np.allclose(out[0].numpy(), layer(tf.constant(x)).numpy())


def test_encoder_fprop_reads_weights_only_from_theta():
    layer = encoder_params().instantiate()
    t = randomize(layer, RNG)
    doubled = tf.nest.map_structure(lambda a: tf.constant(2.0 * a), t)
    x = RNG.normal(size=(2, 5, 8))
    run = tf.function(lambda theta, inputs: layer.fprop(theta, inputs, EVAL), autograph=False)
    out, paddings = run(doubled, (tf.constant(x), tf.constant(PADDINGS)))
    ref = np_encoder(x, PADDINGS, tf.nest.map_structure(lambda a: 2.0 * a, t), layer.p)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10)
    np.testing.assert_array_equal(paddings.numpy(), PADDINGS)


@pytest.mark.parametrize("rate_field", ["dropout_rate", "attention_dropout_rate", "relu_dropout_rate"])
def test_encoder_dropout_is_seeded_and_only_in_training(rate_field):
    layer = encoder_params(**{rate_field: 0.3}).instantiate()
    t = randomize(layer, RNG)
    x = RNG.normal(size=(2, 5, 8))
    inputs = (tf.constant(x), tf.constant(PADDINGS))
    ctx = FPropContext(training=True, seed=tf.constant([1, 2], tf.int64))
    a, b = layer(inputs, ctx)[0].numpy(), layer(inputs, ctx)[0].numpy()
    np.testing.assert_array_equal(a, b)
    other = layer(inputs, FPropContext(training=True, seed=tf.constant([1, 3], tf.int64)))[0].numpy()
    assert not np.allclose(a, other)
    evaluated = layer(inputs, EVAL)[0].numpy()
    np.testing.assert_allclose(evaluated, np_encoder(x, PADDINGS, t, layer.p), rtol=1e-10)
    assert not np.allclose(a, evaluated)
    with pytest.raises(ValueError, match="seed is None"):
        layer(inputs, FPropContext(training=True))


def test_sequential_of_two_encoder_layers_with_tuple_input():
    layers = [encoder_params(pre_norm=True), encoder_params(pre_norm=False, dropout_rate=0.1)]
    seq = Sequential.params().set(layers=layers, dtype="float64").instantiate()
    randomize(seq, RNG)
    x = RNG.normal(size=(2, 5, 8))
    paddings = tf.constant(PADDINGS)
    out = seq((tf.constant(x), paddings))
    ref = x
    for child in seq.children.values():
        ref = np_encoder(ref, PADDINGS, tf.nest.map_structure(lambda v: v.numpy(), child.theta), child.p)
    assert isinstance(out, tuple) and out[1] is paddings
    np.testing.assert_allclose(out[0].numpy(), ref, rtol=1e-10)
    assert Sequential.num_params(seq.p) == num_variable_elements(seq)
    spec = (tf.TensorSpec([2, 5, 8], tf.float64), tf.TensorSpec([2, 5], tf.float64))
    assert Sequential.output_spec(seq.p, spec) == spec
    ctx = FPropContext(training=True, seed=tf.constant([7, 8], tf.int64))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(seq((tf.constant(x), paddings), ctx)[0] ** 2)
    grads = tape.gradient(loss, seq.trainable_variables)
    assert all(g is not None and np.all(np.isfinite(g.numpy())) for g in grads)


def test_gpipe_of_encoder_layers_carries_paddings_and_equals_sequential():
    layers = [encoder_params(), encoder_params(pre_norm=False), encoder_params()]
    seq = Sequential.params().set(name="net", layers=layers, dtype="float64").instantiate()
    pipe = GPipe.params().set(name="net", layers=layers, dtype="float64", num_stages=2, num_micro_batches=2,
                              devices=["/device:CPU:0", "/device:CPU:1"]).instantiate()
    for src, dst in zip(seq.trainable_variables, pipe.trainable_variables):
        dst.assign(src + RNG.normal(scale=0.1, size=src.shape))
        src.assign(dst)
    x = tf.constant(RNG.normal(size=(4, 5, 8)))
    paddings = tf.constant(np.concatenate([PADDINGS, PADDINGS[::-1]]))
    got = tf.function(lambda inputs: pipe.fprop(pipe.theta, inputs, EVAL), autograph=False)((x, paddings))
    ref = seq((x, paddings))
    np.testing.assert_allclose(got[0].numpy(), ref[0].numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(got[1].numpy(), paddings.numpy())


# ------------------------------------------------------------------------------- Params-only cost estimates


@pytest.mark.parametrize("params", [
    MultiHeadAttention.params().set(model_dim=8, num_heads=2),
    MultiHeadAttention.params().set(model_dim=6, num_heads=4, head_dim=5, has_bias=False),
    FeedForward.params().set(model_dim=4, hidden_dim=9),
    FeedForward.params().set(model_dim=4, hidden_dim=9, has_bias=False),
    TransformerEncoderLayer.params().set(model_dim=8, num_heads=2, hidden_dim=12),
    TransformerEncoderLayer.params().set(model_dim=6, num_heads=3, head_dim=4, hidden_dim=5, pre_norm=False),
], ids=["attention", "attention_head_dim_no_bias", "ffn", "ffn_no_bias", "encoder_pre", "encoder_post_head_dim"])
def test_num_params_equals_built_variables(params):
    assert params.cls.num_params(params) == num_variable_elements(params.instantiate())


def test_num_params_of_a_large_layer_from_params_alone(monkeypatch):
    def no_variables(*args, **kwargs):
        raise AssertionError("num_params must not create variables")

    monkeypatch.setattr(tf, "Variable", no_variables)
    # The GPipe paper's Transformer layer (d=2048, FFN 8192, 32 heads): 4d^2+4d attention, FFN, 2 layer norms.
    p = TransformerEncoderLayer.params().set(model_dim=2048, num_heads=32, hidden_dim=8192)
    assert TransformerEncoderLayer.num_params(p) == 50_358_272
    attention = MultiHeadAttention.params().set(model_dim=1024, num_heads=32, head_dim=64)
    assert MultiHeadAttention.num_params(attention) == 4 * 1024 * 2048 + 3 * 2048 + 1024


def test_output_spec_matches_outputs():
    x_spec, pad_spec = tf.TensorSpec([2, 5, 8], tf.float64), tf.TensorSpec([2, 5], tf.float64)
    p = encoder_params()
    assert TransformerEncoderLayer.output_spec(p, x_spec) == x_spec
    assert TransformerEncoderLayer.output_spec(p, (x_spec, pad_spec)) == (x_spec, pad_spec)
    layer = p.instantiate()
    out = layer((tf.zeros(x_spec.shape, x_spec.dtype), tf.zeros(pad_spec.shape, pad_spec.dtype)))
    assert tuple(tf.TensorSpec(t.shape, t.dtype) for t in out) == (x_spec, pad_spec)

    attention = MultiHeadAttention.params().set(model_dim=8, num_heads=2, dtype="float64")
    q_spec, m_spec = tf.TensorSpec([2, 3, 8], tf.float64), tf.TensorSpec([2, 5, 8], tf.float64)
    assert MultiHeadAttention.output_spec(attention, (q_spec, m_spec, None)) == q_spec
    assert MultiHeadAttention.output_spec(attention, q_spec) == q_spec
    out = attention.instantiate()((tf.zeros(q_spec.shape, tf.float64), tf.zeros(m_spec.shape, tf.float64), None))
    assert tf.TensorSpec(out.shape, out.dtype) == q_spec

    ffn = FeedForward.params().set(model_dim=8, hidden_dim=3)
    assert FeedForward.output_spec(ffn, tf.TensorSpec([4, 8], tf.float32)) == tf.TensorSpec([4, 8], tf.float32)


def test_flops_from_params():
    b, t, d, h, hd, hidden = 2, 5, 8, 2, 3, 12
    attention = MultiHeadAttention.params().set(model_dim=d, num_heads=h, head_dim=hd)
    spec = tf.TensorSpec([b, t, d], tf.float32)
    self_flops = 2 * b * t * d * h * hd * 4 + 2 * 2 * b * h * t * t * hd
    assert MultiHeadAttention.flops(attention, spec) == self_flops
    assert MultiHeadAttention.flops(attention, (spec, None, None)) == self_flops
    tk = 7
    cross = MultiHeadAttention.flops(attention, (spec, tf.TensorSpec([b, tk, d], tf.float32), None))
    assert cross == 2 * b * (2 * t + 2 * tk) * d * h * hd + 2 * 2 * b * h * t * tk * hd

    ffn_flops = 2 * b * t * d * hidden * 2 + 3 * b * t * hidden
    assert FeedForward.flops(FeedForward.params().set(model_dim=d, hidden_dim=hidden), spec) == ffn_flops

    encoder = TransformerEncoderLayer.params().set(model_dim=d, num_heads=h, head_dim=hd, hidden_dim=hidden)
    layer_norms_and_residual_dropouts = 2 * 8 * b * t * d + 2 * 3 * b * t * d
    expected = self_flops + ffn_flops + layer_norms_and_residual_dropouts
    assert TransformerEncoderLayer.flops(encoder, spec) == expected
    assert TransformerEncoderLayer.flops(encoder, (spec, tf.TensorSpec([b, t], tf.float32))) == expected
    with pytest.raises(ParamsError, match="static"):
        MultiHeadAttention.flops(attention, tf.TensorSpec([b, None, d], tf.float32))


def test_bad_params_and_inputs_name_the_problem():
    with pytest.raises(ParamsError, match="model_dim=6 is not divisible by num_heads=4"):
        MultiHeadAttention.params().set(model_dim=6, num_heads=4).instantiate()
    with pytest.raises(ParamsError, match="model_dim, num_heads and hidden_dim must be > 0"):
        TransformerEncoderLayer.params().set(model_dim=8, num_heads=2).instantiate()
    with pytest.raises(ParamsError, match="hidden_dim must be > 0"):
        FeedForward.num_params(FeedForward.params().set(model_dim=8))
    layer = MultiHeadAttention.params().set(model_dim=4, num_heads=2).instantiate()
    with pytest.raises(ValueError, match=r"\(query, memory, bias\)"):
        layer((tf.zeros([1, 2, 4]), tf.zeros([1, 2, 4])))
