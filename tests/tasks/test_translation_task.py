"""TranslationTask: the pipeline equals the un-pipelined model; decoding runs in tf.function; the experiment."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.experiment import resolve_params
from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.schedules import SCHEDULES
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.inspection import inspect
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.seq2seq_adapters import EncoderToDecoder
from gpipe_tf.tasks.translation import TranslationTask
from tests.helpers import tiers

VOCAB, B, S, T = 13, 4, 5, 6
BOS, EOS = 1, 2
DEVICES = [f"/device:CPU:{i}" for i in range(2)]


def tiny_params(dtype="float64", k=1, m=1, share=True, schedule="fill_drain"):
    p = TranslationTask.params().set(
        name="translation", dtype=dtype, vocab_size=VOCAB, model_dim=8, num_heads=2, hidden_dim=12,
        num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0, label_smoothing=0.1, share_embeddings=share)
    return p.set(network=TranslationTask.network_params(p, num_stages=k, num_micro_batches=m, devices=DEVICES[:k],
                                                        schedule=schedule))


def tiny_task(dtype="float64", k=1, m=1, share=True, schedule="fill_drain"):
    return tiny_params(dtype, k, m, share, schedule).instantiate()


def embedding_tables(task):
    """The task's token embedding variables (the softmax's weights are not among them)."""
    return [v for v in task.trainable_variables if "token_emb" in v.name]


def tiny_batch():
    rng = np.random.default_rng(0)
    src_len = np.array([5, 3, 4, 2])
    tgt_len = np.array([6, 2, 4, 3])
    src_pad = (np.arange(S)[None] >= src_len[:, None]).astype(np.float32)
    tgt_pad = (np.arange(T)[None] >= tgt_len[:, None]).astype(np.float32)
    src = rng.integers(3, VOCAB, size=(B, S)) * (1 - src_pad)
    tgt_out = rng.integers(3, VOCAB, size=(B, T)) * (1 - tgt_pad)
    tgt_in = np.concatenate([np.full((B, 1), BOS), tgt_out[:, :-1]], 1) * (1 - tgt_pad)
    return {"src_ids": tf.constant(src, tf.int32), "src_paddings": tf.constant(src_pad),
            "tgt_in_ids": tf.constant(tgt_in, tf.int32), "tgt_out_ids": tf.constant(tgt_out, tf.int32),
            "tgt_paddings": tf.constant(tgt_pad)}


def loss_and_grads(task, batch, training=False):
    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            loss, metrics = task.compute_loss(task.theta, batch, FPropContext(training=training))
        with placement.colocate_gradients():
            grads = tape.gradient(loss, task.trainable_variables)
        return loss, metrics["token_accuracy"][0], grads

    loss, acc, grads = step()
    return float(loss), float(acc), {v.name: g.numpy() for v, g in zip(task.trainable_variables, grads)}


@pytest.mark.parametrize("share", tiers.sample([True, False], keep=[True]))
def test_pipelined_equals_unpipelined_loss_and_gradients(share):
    batch = tiny_batch()
    ref = loss_and_grads(tiny_task(k=1, m=1, share=share), batch)
    got = loss_and_grads(tiny_task(k=2, m=2, share=share), batch)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-10)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-10)
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        np.testing.assert_allclose(got[2][name], ref[2][name], rtol=1e-9, atol=1e-12, err_msg=name)
    # Every weight, including the embedding table(s) and the decoder's cross-attention, gets a gradient.
    assert all(np.any(g != 0) for name, g in ref[2].items() if "bias" not in name and "/b" not in name)


@pytest.mark.parametrize("schedule,k,m", tiers.sample(
    [("one_f_one_b", 2, 2), ("one_f_one_b", 2, 4), ("interleaved", 2, 2), ("zero_bubble", 2, 4),
     ("zero_bubble_v", 2, 4), ("zero_bubble_v+batched_w", 2, 4), ("fill_drain+batched_w", 2, 4)],
    keep=[("interleaved", 2, 2), ("zero_bubble_v+batched_w", 2, 4)]))
def test_loss_in_the_pipeline_per_micro_batch_equals_unpipelined(schedule, k, m):
    """Padding weights combine per micro-batch exactly as in the full-batch loss (the micro-batches here hold
    different numbers of real tokens), the metric too; with batched weight gradients (the attention and FFN
    projections' W over all micro-batches) too."""
    if schedule.endswith("+batched_w"):
        schedule = SCHEDULES[schedule[:-len("+batched_w")]].params().set(batch_weight_gradients=True)
    batch = tiny_batch()
    ref = loss_and_grads(tiny_task(k=1, m=1), batch, training=True)
    got = loss_and_grads(tiny_task(k=k, m=m, schedule=schedule), batch, training=True)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-10)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-10)
    for name in ref[2]:
        np.testing.assert_allclose(got[2][name], ref[2][name], rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("k", tiers.sample([1, 2], keep=[2]))
def test_shared_embedding_is_one_table_that_source_and_target_gradients_reach(k):
    task = tiny_task(k=k, m=k)
    tables = embedding_tables(task)
    assert len(tables) == 1 and tables[0].shape == (VOCAB, 8)
    assert len(embedding_tables(tiny_task(share=False))) == 2
    # Source ids from {3..7}, target ids from {BOS} and {8..12}: the two halves of the table's gradient can only
    # come from the source and from the target respectively.
    batch = dict(tiny_batch())
    real_src = (1 - batch["src_paddings"].numpy()).astype(np.int32)
    real_tgt = (1 - batch["tgt_paddings"].numpy()).astype(np.int32)
    src = (3 + batch["src_ids"].numpy() % 5) * real_src
    tgt_out = (8 + batch["tgt_out_ids"].numpy() % 5) * real_tgt
    tgt_in = np.concatenate([np.full((B, 1), BOS), tgt_out[:, :-1]], 1) * real_tgt
    batch.update(src_ids=tf.constant(src, tf.int32), tgt_in_ids=tf.constant(tgt_in, tf.int32),
                 tgt_out_ids=tf.constant(tgt_out, tf.int32))
    _, _, grads = loss_and_grads(task, batch)
    table_grad = grads[tables[0].name]
    row_norms = np.abs(table_grad).sum(-1)
    for ids in (np.unique(src[real_src > 0]), np.unique(tgt_in[real_tgt > 0])):
        assert np.all(row_norms[ids] > 0), (ids, row_norms)
    unused = sorted(set(range(VOCAB)) - set(src.ravel()) - set(tgt_in.ravel()))
    assert unused and np.all(row_norms[unused] == 0)


@pytest.mark.parametrize("share", [True, False])
def test_num_params_from_params_equals_built_variables(share):
    p = tiny_params(share=share)
    task = p.instantiate()
    assert TranslationTask.num_params(p) == sum(int(np.prod(v.shape)) for v in task.trainable_variables)
    assert TranslationTask.num_params(tiny_params(share=False)) - TranslationTask.num_params(
        tiny_params(share=True)) == VOCAB * 8


def test_output_specs_and_flops_from_params_with_and_without_sharing():
    spec = (tf.TensorSpec([B, S], tf.int32), tf.TensorSpec([B, S], tf.float64), tf.TensorSpec([B, T], tf.int32),
            tf.TensorSpec([B, T], tf.float64))
    flops = {}
    for share in (True, False):
        layers = TranslationTask.network_params(tiny_params(share=share)).layers
        specs, total = spec, 0.0
        for lp in layers:
            total += lp.cls.flops(lp, specs)
            specs = lp.cls.output_spec(lp, specs)
            if lp is layers[0]:
                # With sharing the first stage already hands the embedded target [B, T, D] to the encoder stages.
                assert specs[2].shape == ([B, T, 8] if share else [B, T])
        assert specs.shape == [B, T, 8]
        flops[share] = total
    # Sharing moves the target lookup from EncoderToDecoder to the first layer; it does not change the work.
    assert flops[True] == flops[False] > 0


def test_network_must_embed_the_target_exactly_once_and_as_share_embeddings_says():
    p = tiny_params(share=True)
    p.network = TranslationTask.network_params(p)
    p.share_embeddings = False
    with pytest.raises(ParamsError, match="share_embeddings=False but"):
        p.instantiate()
    e2d = next(lp for lp in p.network.layers if lp.cls is EncoderToDecoder)
    e2d.embed_target = True  # now both the SourceEmbedding and the EncoderToDecoder embed the target
    with pytest.raises(ParamsError, match="exactly one of"):
        p.instantiate()


@pytest.mark.parametrize("beam_size", [1, 3])
def test_decode_in_tf_function_returns_valid_ids(beam_size):
    task = tiny_task(dtype="float32", k=2, m=2)
    batch = tiny_batch()
    max_length = 7

    @tf.function(autograph=False)
    def run(src_ids, src_paddings):
        return task.decode({"src_ids": src_ids, "src_paddings": src_paddings}, max_length, beam_size=beam_size,
                           length_penalty_alpha=0.6, bos_id=BOS, eos_id=EOS)

    ids = run(batch["src_ids"], batch["src_paddings"]).numpy()
    assert ids.shape == (B, max_length) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < VOCAB
    for row in ids:
        hits = np.flatnonzero(row == EOS)
        if hits.size:
            assert np.all(row[hits[0]:] == EOS)


@pytest.mark.parametrize("share", [True, False])
def test_greedy_decode_matches_teacher_forced_argmax(share):
    # Feeding the greedy output back as the target, the full (pipelined) pass must predict the same tokens; this
    # also pins that step-wise decoding embeds target tokens with the table training used.
    task = tiny_task(dtype="float64", k=2, m=2, share=share)
    batch = tiny_batch()
    max_length = 5
    ids = task.decode(batch, max_length, bos_id=BOS, eos_id=EOS).numpy()
    tgt_in = np.concatenate([np.full((B, 1), BOS), ids[:, :-1]], 1)
    ctx = FPropContext(training=False)
    features = task.network.fprop(task.theta["network"], (
        batch["src_ids"], tf.cast(batch["src_paddings"], tf.float64), tf.constant(tgt_in, tf.int32),
        tf.zeros([B, max_length], tf.float64)), ctx)
    logits = task.softmax.fprop(task.theta["softmax"], features, ctx).numpy()
    pred = logits.argmax(-1)
    for b in range(B):
        hits = np.flatnonzero(ids[b] == EOS)
        end = hits[0] + 1 if hits.size else max_length
        np.testing.assert_array_equal(pred[b, :end], ids[b, :end])


def test_experiment_resolves_and_inspect_reports_stages():
    params, _ = resolve_params("mt.number_words.NumbersTiny")
    assert params.logical_devices == 4
    assert params.task.network.num_stages == 2 and params.task.network.num_micro_batches == 4
    report = inspect(params)
    assert report["pipeline"] is not None
    assert len(report["stages"]) == 2
    assert report["total_params"] == sum(s["params"] for s in report["stages"]) + 128 * 1000 + 1000
