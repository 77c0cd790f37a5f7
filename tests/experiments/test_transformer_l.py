"""GPipe Table 1's Transformer-L as a language model: causal layers, the tiny offline variant trains, and the
paper-size experiments read real (here: fake, prepared by the real builder) TFDS lm1b without building the model."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.inputs.tfds_language_model import TfdsLanguageModelInput
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.summaries import read_scalars
from tests.helpers import fake_tfds_text

PAPER_SIZES = ("TransformerL_3", "TransformerL_13", "TransformerL_103")


@pytest.fixture(scope="module")
def lm1b(tmp_path_factory):
    """(data_dir, vocab_dir) with fake lm1b prepared by the real builder."""
    root = tmp_path_factory.mktemp("lm1b")
    fake_tfds_text.prepare_lm1b(str(root / "data"), str(root / "source"))
    return str(root / "data"), str(root / "vocab")


def test_causal_layer_ignores_later_positions():
    p = TransformerEncoderLayer.params().set(name="layer", model_dim=8, num_heads=2, hidden_dim=16, dtype="float64")
    causal, full = p.copy().set(causal=True).instantiate(), p.instantiate()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=[2, 6, 8]))
    later_changed = tf.concat([x[:, :4], rng.normal(size=[2, 2, 8])], axis=1)
    ctx = FPropContext(training=False)
    for layer, independent in ((causal, True), (full, False)):
        a, b = layer.fprop(layer.theta, x, ctx), layer.fprop(layer.theta, later_changed, ctx)
        assert np.allclose(a[:, :4], b[:, :4], rtol=1e-12) == independent
    # With paddings too (pipelined stacks carry them): the masks add.
    paddings = tf.constant([[0.0] * 6, [0.0] * 5 + [1.0]], tf.float64)
    a, _ = causal.fprop(causal.theta, (x, paddings), ctx)
    np.testing.assert_allclose(a[:, :4], causal.fprop(causal.theta, (later_changed, paddings), ctx)[0][:, :4])


def test_tiny_offline_variant_learns_the_numbers_language_model(tmp_path):
    """TransformerLTinyOffline (K=2, M=4 on logical CPUs): 40 steps take the loss from ~ln(500) to well below."""
    params, _ = experiment.resolve_params(
        "mt.gpipe_paper.TransformerLTinyOffline", gin_bindings=[f"TransformerLTinyOffline.vocab_dir = '{tmp_path}'"],
        overrides="train.max_steps=40,train.summary_interval_steps=1,train.save_interval_steps=1000")
    network = params.task.network
    assert (network.num_stages, network.num_micro_batches, params.logical_devices) == (2, 4, 4)
    assert all(lp.causal for lp in network.layers[1:-1])
    logdir = str(tmp_path / "run")
    logdir_lib.prepare(logdir, params)
    Controller(params, logdir, log=lambda s: None).train()
    losses = np.array([v for _, v in read_scalars(f"{logdir}/train")["loss"]])
    assert len(losses) == 40 and abs(losses[0] - np.log(500)) < 1.0
    assert losses[-5:].mean() < 0.65 * losses[0], losses


@pytest.mark.parametrize("name", PAPER_SIZES)
def test_paper_sizes_read_tfds_lm1b(lm1b, name):
    """The Transformer-L experiments' input Params, pointed at the fake lm1b, build working inputs (the model is
    not built: 282M to 5.3B parameters)."""
    data_dir, vocab_dir = lm1b
    params, _ = experiment.resolve_params(f"mt.gpipe_paper.{name}", gin_bindings=[
        f"{name}.data_dir = '{data_dir}'", f"{name}.vocab_dir = '{vocab_dir}'"])
    assert params.task.softmax.num_classes == 32000
    for dataset, split in (("train", "train"), ("dev", "test[:50%]"), ("test", "test[50%:]")):
        p = params.input.get(dataset)
        assert p.cls is TfdsLanguageModelInput and (p.dataset, p.split, p.data_dir) == ("lm1b", split, data_dir)
        assert (p.vocab_size, p.max_length, p.batch_size) == (32000, 1024, 32)
        assert (p.num_batches is None) == (dataset == "train")
    # Tiny text cannot fill 32k ids nor 32-sentence batches; the other settings are the experiment's.
    inp = params.input.train.copy().set(vocab_size=100, batch_size=2).instantiate()
    assert inp.bucket_lengths == (8, 16, 32, 64, 128, 256, 512, 1024)
    batch = next(iter(inp.dataset()))
    assert set(batch) == {"inputs", "labels", "weights"} and batch["inputs"].shape[0] == 2
    assert inp.vocab.decode(batch["labels"][0].numpy()).startswith("They counted")


@pytest.mark.exhaustive(covered_by=(
    "tests/inputs/test_language_model_input.py::test_lm1b_training_batches_are_bucketed_and_deterministic",
    "tests/experiments/test_transformer_l.py::test_tiny_offline_variant_learns_the_numbers_language_model",
))
def test_transformer_l_trains_on_tfds_lm1b_through_the_trainer(lm1b, tmp_path):
    """Transformer-L's task and inputs, shrunk by knobs only, train and evaluate on lm1b with the real trainer."""
    data_dir, vocab_dir = lm1b
    knobs = dict(data_dir=repr(data_dir), vocab_dir=repr(vocab_dir), vocab_size=100, max_length=32, batch_size=4,
                 model_dim=16, num_heads=2, hidden_dim=32, num_layers=2, num_stages=2, num_micro_batches=2,
                 eval_batches=1)
    params, _ = experiment.resolve_params(
        "mt.gpipe_paper.TransformerL_103", gin_bindings=[f"TransformerL_103.{k} = {v}" for k, v in knobs.items()],
        # One bucket for evaluation: 5 fake sentences per half fill one batch of 4 only if they share a bucket.
        overrides="train.max_steps=3,input.dev.bucket_lengths=[32],input.test.bucket_lengths=[32]")
    logdir = str(tmp_path / "run")
    logdir_lib.prepare(logdir, params)
    controller = Controller(params, logdir, log=lambda s: None)
    assert np.isfinite(controller.train()["loss"])
    (step, results), = controller.evaluate().items()
    assert step == 3 and set(results) == {"dev", "test"}
    assert all(np.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in results.values())
