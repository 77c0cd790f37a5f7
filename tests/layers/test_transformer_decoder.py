"""Transformer decoder layer and token embedding with positions: NumPy references, Params-only costs, incremental
decoding against the full pass, a GPipe of decoder layers, and decoding a real layer with greedy and beam search."""

import math

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.decoding import beam_search, greedy_search, length_penalty
from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.attention import FeedForward, MultiHeadAttention
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.embedding import Embedding
from gpipe_tf.layers.positions import TokenEmbeddingWithPositions, sinusoidal_encoding, sinusoidal_positions
from gpipe_tf.layers.sequential import Sequential
from gpipe_tf.layers.softmax import SoftmaxCrossEntropy
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from gpipe_tf.layers.transformer_decoder import TransformerDecoderLayer
from tests.helpers import tiers
from tests.helpers.np_reference import np_attention, np_layer_norm, np_linear, num_variable_elements, randomize

RNG = np.random.default_rng(0)
EVAL = FPropContext(training=False)
TGT_PADDINGS = np.array([[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0, 1.0]])
SRC_PADDINGS = np.array([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])

# ------------------------------------------------------------------------------------------ NumPy references


def np_decoder(x, tgt_paddings, memory, src_paddings, t, p):
    length = x.shape[1]
    self_masked = np.triu(np.ones((length, length), bool), k=1)[None, None]
    if tgt_paddings is not None:
        self_masked = self_masked | (tgt_paddings > 0)[:, None, None, :]
    cross_masked = None if src_paddings is None else (src_paddings > 0)[:, None, None, :]
    blocks = [
        ("self_atten", lambda h: np_attention(t["self_atten"], h, h, self_masked, p.num_heads)[0]),
        ("cross_atten", lambda h: np_attention(t["cross_atten"], h, memory, cross_masked, p.num_heads)[0]),
        ("ffn", lambda h: np_linear(np.maximum(np_linear(h, t["ffn"]["fc1"]), 0), t["ffn"]["fc2"])),
    ]
    for name, fn in blocks:
        ln = t[f"{name}_ln"]
        if p.pre_norm:
            x = x + fn(np_layer_norm(x, ln, p.ln_epsilon))
        else:
            x = np_layer_norm(x + fn(x), ln, p.ln_epsilon)
    return x


def np_log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def decoder_params(pre_norm=True, **kwargs):
    return TransformerDecoderLayer.params().set(model_dim=8, num_heads=2, hidden_dim=12, pre_norm=pre_norm,
                                                dtype="float64", **kwargs)


def decoder_inputs(batch=2, length=5, src_length=4, kind=tuple):
    x, memory = RNG.normal(size=(batch, length, 8)), RNG.normal(size=(batch, src_length, 8))
    inputs = kind((tf.constant(x), tf.constant(TGT_PADDINGS), tf.constant(memory), tf.constant(SRC_PADDINGS)))
    return x, memory, inputs


# ------------------------------------------------------------------------------------------ decoder layer


@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("kind", [tuple, list])
def test_decoder_layer_matches_numpy_with_padding_and_causal_masks(pre_norm, kind):
    layer = decoder_params(pre_norm, ln_epsilon=1e-3).instantiate()
    t = randomize(layer, RNG)
    x, memory, inputs = decoder_inputs(kind=kind)
    out = layer(inputs)
    assert type(out) is kind and len(out) == 4
    assert all(out[i] is inputs[i] for i in (1, 2, 3))
    np.testing.assert_allclose(out[0].numpy(), np_decoder(x, TGT_PADDINGS, memory, SRC_PADDINGS, t, layer.p),
                               rtol=1e-10)
    # Causality: changing the last target position changes no earlier output.
    changed = x.copy()
    changed[:, -1] += 10.0
    out2 = layer(kind((tf.constant(changed), *inputs[1:])))
    np.testing.assert_array_equal(out2[0].numpy()[:, :-1], out[0].numpy()[:, :-1])
    # Padded source positions are ignored entirely, padded target keys too.
    noisy = memory + 1e3 * SRC_PADDINGS[:, :, None]
    np.testing.assert_array_equal(layer(kind((inputs[0], inputs[1], tf.constant(noisy), inputs[3])))[0].numpy(),
                                  out[0].numpy())
    unmasked = layer(kind((inputs[0], tf.zeros_like(inputs[1]), inputs[2], tf.zeros_like(inputs[3]))))[0].numpy()
    assert not np.allclose(unmasked, out[0].numpy())


def test_decoder_layer_without_paddings_is_only_causal():
    layer = decoder_params().instantiate()
    t = randomize(layer, RNG)
    x, memory, inputs = decoder_inputs()
    out = layer((inputs[0], None, inputs[2], None))
    assert out[1] is None and out[3] is None
    np.testing.assert_allclose(out[0].numpy(), np_decoder(x, None, memory, None, t, layer.p), rtol=1e-10)


def test_decoder_fprop_reads_weights_only_from_theta():
    layer = decoder_params().instantiate()
    t = randomize(layer, RNG)
    doubled = tf.nest.map_structure(lambda a: tf.constant(2.0 * a), t)
    x, memory, inputs = decoder_inputs()
    out = tf.function(lambda theta, i: layer.fprop(theta, i, EVAL), autograph=False)(doubled, inputs)
    ref = np_decoder(x, TGT_PADDINGS, memory, SRC_PADDINGS, tf.nest.map_structure(lambda a: 2.0 * a, t), layer.p)
    np.testing.assert_allclose(out[0].numpy(), ref, rtol=1e-10)


@pytest.mark.parametrize("rate_field", ["dropout_rate", "attention_dropout_rate", "relu_dropout_rate"])
def test_decoder_dropout_is_seeded_and_only_in_training(rate_field):
    layer = decoder_params(**{rate_field: 0.3}).instantiate()
    randomize(layer, RNG)
    _, _, inputs = decoder_inputs()
    ctx = FPropContext(training=True, seed=tf.constant([1, 2], tf.int64))
    a, b = layer(inputs, ctx)[0].numpy(), layer(inputs, ctx)[0].numpy()
    np.testing.assert_array_equal(a, b)
    other = layer(inputs, FPropContext(training=True, seed=tf.constant([1, 3], tf.int64)))[0].numpy()
    assert not np.allclose(a, other)
    assert not np.allclose(a, layer(inputs, EVAL)[0].numpy())


def test_decoder_rejects_other_input_structures():
    layer = decoder_params().instantiate()
    with pytest.raises(ValueError, match=r"\(x, tgt_paddings, memory, src_paddings\)"):
        layer(tf.zeros([1, 2, 8], tf.float64))
    with pytest.raises(ValueError, match="a sequence of 2"):
        layer((tf.zeros([1, 2, 8], tf.float64), tf.zeros([1, 2], tf.float64)))
    with pytest.raises(ParamsError, match="model_dim, num_heads and hidden_dim must be > 0"):
        TransformerDecoderLayer.params().set(model_dim=8, num_heads=2).instantiate()


# ------------------------------------------------------------------------------- Params-only cost estimates


def test_decoder_params_extend_the_encoder_params():
    encoder, decoder = TransformerEncoderLayer.params(), TransformerDecoderLayer.params()
    # All but `cls`, and the encoder's `causal` switch (a decoder's self-attention is always causal).
    shared = [k for k in encoder.keys()[1:] if k != "causal"]
    assert decoder.keys()[1:] == shared
    assert all(decoder.get(k) == encoder.get(k) for k in shared)


@pytest.mark.parametrize("params", [
    TransformerDecoderLayer.params().set(model_dim=8, num_heads=2, hidden_dim=12),
    TransformerDecoderLayer.params().set(model_dim=6, num_heads=3, head_dim=4, hidden_dim=5, pre_norm=False),
], ids=["pre_norm", "post_norm_head_dim"])
def test_decoder_num_params_equals_built_variables(params):
    layer = params.instantiate()
    assert TransformerDecoderLayer.num_params(params) == num_variable_elements(layer)
    d, hidden = params.model_dim, params.hidden_dim
    inner = params.num_heads * (params.head_dim or d // params.num_heads)
    attention = 4 * d * inner + 3 * inner + d
    ffn = 2 * d * hidden + hidden + d
    assert TransformerDecoderLayer.num_params(params) == 2 * attention + ffn + 3 * 2 * d


def test_decoder_num_params_of_a_large_layer_from_params_alone(monkeypatch):
    def no_variables(*args, **kwargs):
        raise AssertionError("num_params must not create variables")

    monkeypatch.setattr(tf, "Variable", no_variables)
    d, hidden = 2048, 8192
    p = TransformerDecoderLayer.params().set(model_dim=d, num_heads=32, hidden_dim=hidden)
    encoder = TransformerEncoderLayer.params().set(model_dim=d, num_heads=32, hidden_dim=hidden)
    # The encoder layer plus one more attention block (4d^2 + 4d) and one more layer norm (2d).
    extra = 4 * d * d + 4 * d + 2 * d
    assert TransformerDecoderLayer.num_params(p) == TransformerEncoderLayer.num_params(encoder) + extra


def test_decoder_output_spec_and_flops():
    b, t, s, d, h, hd, hidden = 2, 5, 4, 8, 2, 3, 12
    x_spec, tgt_spec = tf.TensorSpec([b, t, d], tf.float64), tf.TensorSpec([b, t], tf.float64)
    mem_spec, src_spec = tf.TensorSpec([b, s, d], tf.float64), tf.TensorSpec([b, s], tf.float64)
    spec = (x_spec, tgt_spec, mem_spec, src_spec)
    p = decoder_params()
    assert TransformerDecoderLayer.output_spec(p, spec) == spec
    out = p.instantiate()(tuple(tf.zeros(sp.shape, sp.dtype) for sp in spec))
    assert tuple(tf.TensorSpec(o.shape, o.dtype) for o in out) == spec

    p = TransformerDecoderLayer.params().set(model_dim=d, num_heads=h, head_dim=hd, hidden_dim=hidden)
    attention = MultiHeadAttention.params().set(model_dim=d, num_heads=h, head_dim=hd)
    self_flops = 2 * b * t * d * h * hd * 4 + 2 * 2 * b * h * t * t * hd
    cross_flops = 2 * b * (2 * t + 2 * s) * d * h * hd + 2 * 2 * b * h * t * s * hd
    assert MultiHeadAttention.flops(attention, (x_spec, mem_spec, None)) == cross_flops
    ffn_flops = FeedForward.flops(FeedForward.params().set(model_dim=d, hidden_dim=hidden), x_spec)
    norms_and_dropouts = 3 * 8 * b * t * d + 3 * 3 * b * t * d
    assert TransformerDecoderLayer.flops(p, spec) == self_flops + cross_flops + ffn_flops + norms_and_dropouts


# --------------------------------------------------------------------------------------- incremental decoding


@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("cached_memory", [False, True])
def test_extend_step_equals_full_fprop_at_every_position(pre_norm, cached_memory):
    layer = decoder_params(pre_norm).instantiate()
    randomize(layer, RNG)
    x, memory, _ = decoder_inputs()
    x, memory, src = tf.constant(x), tf.constant(memory), tf.constant(SRC_PADDINGS)
    full = layer((x, tf.zeros([2, 5], tf.float64), memory, src))[0].numpy()
    # A buffer longer than the sequence: positions not yet written must not be attended to.
    cache = layer.init_cache(2, 7, memory=memory if cached_memory else None)
    assert cache["key"].shape == (2, 7, 2, 4) and cache["step"].dtype == tf.int32
    assert ("cross_key" in cache) == cached_memory
    step = tf.function(lambda xs, c: layer.extend_step(layer.theta, xs, c, None if cached_memory else memory, src,
                                                       EVAL), autograph=False)
    for t in range(5):
        y, new_cache = step(x[:, t:t + 1], cache)
        assert y.shape == (2, 1, 8)
        assert tf.nest.map_structure(lambda a: a.shape, new_cache) == tf.nest.map_structure(lambda a: a.shape, cache)
        np.testing.assert_allclose(y.numpy()[:, 0], full[:, t], rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(new_cache["step"].numpy(), [t + 1, t + 1])
        cache = new_cache
    assert np.all(cache["key"].numpy()[:, 5:] == 0.0)


def test_extend_step_needs_memory_or_a_cached_one():
    layer = decoder_params().instantiate()
    with pytest.raises(ValueError, match="memory is None"):
        layer.extend_step(layer.theta, tf.zeros([1, 1, 8], tf.float64), layer.init_cache(1, 3), None, None, EVAL)


# ------------------------------------------------------------------------------------------------ GPipe


@pytest.mark.parametrize("schedule", tiers.sample(["unrolled", "fill_drain"], keep=["fill_drain"]))
def test_gpipe_of_two_decoder_layers_equals_sequential_in_loss_and_gradients(schedule):
    layers = [decoder_params(pre_norm=True), decoder_params(pre_norm=False)]
    seq = Sequential.params().set(name="net", layers=layers, dtype="float64").instantiate()
    pipe = GPipe.params().set(name="net", layers=layers, dtype="float64", num_stages=2, num_micro_batches=2,
                              devices=["/device:CPU:0", "/device:CPU:1"], schedule=schedule).instantiate()
    for src, dst in zip(seq.trainable_variables, pipe.trainable_variables):
        dst.assign(src + RNG.normal(scale=0.3, size=src.shape))
        src.assign(dst)
    # The memory comes from a variable, so its gradient has to travel back through both stages.
    memory_var = tf.Variable(RNG.normal(size=(4, 4, 8)))
    x = tf.constant(RNG.normal(size=(4, 5, 8)))
    tgt = tf.constant(np.concatenate([TGT_PADDINGS, TGT_PADDINGS[::-1]]))
    src = tf.constant(np.concatenate([SRC_PADDINGS, SRC_PADDINGS[::-1]]))

    def loss_and_grads(layer):
        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                out = layer.fprop(layer.theta, (x, tgt, tf.tanh(memory_var), src), EVAL)
                loss = tf.reduce_sum(out[0] ** 2) + tf.reduce_sum(out[2] ** 3)
            with placement.colocate_gradients():
                grads = tape.gradient(loss, layer.trainable_variables + (memory_var,))
            return loss, grads, out

        loss, grads, out = step()
        return loss.numpy(), [g.numpy() for g in grads], out

    ref_loss, ref_grads, ref_out = loss_and_grads(seq)
    got_loss, got_grads, got_out = loss_and_grads(pipe)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-10)
    assert len(got_grads) == len(ref_grads) == len(seq.trainable_variables) + 1
    for got, ref in zip(got_grads, ref_grads):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)
    assert np.abs(got_grads[-1]).max() > 0
    for i in (1, 3):
        np.testing.assert_array_equal(got_out[i].numpy(), ref_out[i].numpy())


# ---------------------------------------------------------------------------------------------- positions


def np_positions(positions, dim, max_timescale=1e4):
    half = dim // 2
    inv = np.exp(-np.arange(half) * np.log(max_timescale) / max(half - 1, 1))
    scaled = np.asarray(positions, np.float64)[..., None] * inv
    signal = np.concatenate([np.sin(scaled), np.cos(scaled)], -1)
    return np.concatenate([signal, np.zeros(signal.shape[:-1] + (dim % 2,))], -1)


@pytest.mark.parametrize("dim", [8, 7, 2])
def test_sinusoidal_positions_match_the_formula(dim):
    got = sinusoidal_positions(6, dim, tf.float64).numpy()
    assert got.shape == (6, dim)
    np.testing.assert_allclose(got, np_positions(np.arange(6), dim), rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(got[0, :dim // 2], 0.0)
    np.testing.assert_array_equal(got[0, dim // 2:2 * (dim // 2)], 1.0)
    at = sinusoidal_encoding(tf.constant([[3], [5]]), dim, tf.float64).numpy()
    np.testing.assert_array_equal(at[:, 0], got[[3, 5]])
    assert sinusoidal_positions(3, dim).dtype == tf.float32


def test_token_embedding_with_positions():
    p = TokenEmbeddingWithPositions.params().set(vocab_size=11, embedding_dim=6, dtype="float64")
    layer = p.instantiate()
    table = layer.theta["token_emb"]["emb"].numpy()
    # The table starts at stddev 1/sqrt(dim), so the scaled vectors have unit scale like the encodings.
    unscaled = TokenEmbeddingWithPositions.params().set(vocab_size=11, embedding_dim=6, dtype="float64",
                                                        scale_sqrt_depth=False).instantiate()
    np.testing.assert_allclose(table * math.sqrt(6), unscaled.theta["token_emb"]["emb"].numpy(), rtol=1e-12)
    ids = np.array([[1, 4, 10], [0, 0, 3]])
    out = layer(tf.constant(ids)).numpy()
    np.testing.assert_allclose(out, table[ids] * math.sqrt(6) + np_positions(np.arange(3), 6), rtol=1e-12)
    at = layer.fprop_with_positions(layer.theta, tf.constant(ids[:, 2:]), tf.constant([[2], [2]]), EVAL).numpy()
    np.testing.assert_allclose(at, out[:, 2:], rtol=1e-12)
    assert TokenEmbeddingWithPositions.num_params(p) == num_variable_elements(layer) == 66
    spec = tf.TensorSpec([2, 3], tf.int32)
    assert TokenEmbeddingWithPositions.output_spec(p, spec) == tf.TensorSpec([2, 3, 6], tf.float64)
    n = 2 * 3 * 6
    assert TokenEmbeddingWithPositions.flops(p, spec) == n + n + n + 3 * n
    dropped = TokenEmbeddingWithPositions.params().set(vocab_size=11, embedding_dim=6, dropout_rate=0.5)
    train = FPropContext(training=True, seed=tf.constant([3, 4], tf.int64))
    assert np.any(dropped.instantiate()(tf.constant(ids), train).numpy() == 0.0)
    with pytest.raises(ParamsError, match="vocab_size and embedding_dim must be > 0"):
        TokenEmbeddingWithPositions.params().set(embedding_dim=4).instantiate()
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        layer(tf.constant([1, 2]))
    assert isinstance(layer.children["token_emb"], Embedding) and isinstance(layer.children["dropout"], Dropout)


# ------------------------------------------------------------------- decoding a real layer with the searches

VOCAB, BOS, EOS, MAX_LEN = 7, 0, 1, 5


class TinyDecoder:
    """Embedding, one decoder layer and a softmax: a full teacher-forced pass and a step function over caches."""

    def __init__(self):
        self.emb = TokenEmbeddingWithPositions.params().set(name="emb", vocab_size=VOCAB, embedding_dim=8,
                                                            dtype="float64").instantiate()
        self.dec = decoder_params(name="dec").instantiate()
        self.softmax = SoftmaxCrossEntropy.params().set(name="softmax", input_dim=8, num_classes=VOCAB,
                                                        dtype="float64").instantiate()
        for layer in (self.emb, self.dec, self.softmax):
            randomize(layer, RNG, scale=0.7)
        self.memory = tf.constant(RNG.normal(size=(2, 4, 8)))
        self.src = tf.constant(SRC_PADDINGS)

    def log_probs(self, inputs):
        """Teacher-forced log-probabilities [B, T, V] of the next token after each of `inputs` [B, T]."""
        x = self.emb(tf.constant(inputs))
        y = self.dec((x, tf.zeros(inputs.shape, tf.float64), self.memory, self.src))[0]
        return np_log_softmax(self.softmax(y).numpy())

    def initial_state(self):
        cache = self.dec.init_cache(2, MAX_LEN, memory=self.memory)
        return {"cache": cache, "src": self.src}

    def step_fn(self, ids_t, state, t):
        x = self.emb.fprop_with_positions(self.emb.theta, ids_t[:, tf.newaxis], tf.fill(tf.shape(ids_t), t)[:, None],
                                          EVAL)
        y, cache = self.dec.extend_step(self.dec.theta, x, state["cache"], None, state["src"], EVAL)
        logits = self.softmax(y[:, 0])
        return tf.nn.log_softmax(logits), {"cache": cache, "src": state["src"]}


def hypothesis_log_prob(model, row, seq):
    """Sum of the full pass's log-probabilities of `seq` (up to and including its first EOS) and its length."""
    length = int(np.argmax(seq == EOS)) + 1 if np.any(seq == EOS) else len(seq)
    inputs = np.concatenate([[BOS], seq[:-1]])[None]
    lp = model.log_probs(np.repeat(inputs, 2, axis=0))[row]
    return sum(lp[t, seq[t]] for t in range(length)), length


def test_searches_over_a_decoder_layer_with_caches_agree_with_the_full_pass():
    model = TinyDecoder()
    greedy = tf.function(lambda: greedy_search(model.step_fn, model.initial_state(), 2, MAX_LEN, BOS, EOS),
                         autograph=False)()
    for row in range(2):
        seq = greedy.numpy()[row]
        lp = model.log_probs(np.concatenate([[BOS], seq[:-1]])[None].repeat(2, 0))[row]
        for t in range(MAX_LEN):
            assert seq[t] == np.argmax(lp[t])
            if seq[t] == EOS:
                assert np.all(seq[t + 1:] == EOS)
                break
    alpha = 0.6
    ids, scores = tf.function(lambda: beam_search(model.step_fn, model.initial_state(), 2, 3, MAX_LEN, BOS, EOS,
                                                  alpha, dtype=tf.float64), autograph=False)()
    ids, scores = ids.numpy(), scores.numpy()
    assert ids.shape == (2, 3, MAX_LEN) and scores.shape == (2, 3)
    # Rescoring every hypothesis with the full pass checks that the caches were reordered with their beams.
    for row in range(2):
        assert np.all(np.diff(scores[row]) <= 0)
        for k in range(3):
            log_prob, length = hypothesis_log_prob(model, row, ids[row, k])
            np.testing.assert_allclose(scores[row, k], log_prob / length_penalty(length, alpha, tf.float64).numpy(),
                                       rtol=1e-9)
