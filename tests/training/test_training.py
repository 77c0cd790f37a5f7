"""End-to-end training in one process: the toy experiment learns, writes summaries, evaluates."""

import numpy as np
import pytest

from gpipe_tf import experiment
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.summaries import read_scalars

KEY = "toy.classifier.BlobsMlp"
TRAIN_SCALARS = {"loss", "learning_rate", "grad_norm", "examples_per_sec", "steps_per_sec", "accuracy"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("run"))
    params, _ = experiment.resolve_params(KEY, overrides="train.max_steps=200,train.summary_interval_steps=1")
    logdir_lib.prepare(logdir, params)
    lines = []
    Controller(params, logdir, log=lines.append).train()
    return logdir, params, lines


def test_loss_halves_in_200_steps_and_every_scalar_is_written(trained):
    logdir, _, lines = trained
    scalars = read_scalars(f"{logdir}/train")
    assert TRAIN_SCALARS <= set(scalars)
    losses = scalars["loss"]
    assert losses[0][0] == 1 and losses[-1][0] == 200
    first, last = losses[0][1], np.mean([v for _, v in losses[-10:]])
    assert last < 0.5 * first, (first, last)
    assert all(v > 0 for _, v in scalars["examples_per_sec"])
    assert any(line.startswith("step 200/200 loss=") and "eta=" in line for line in lines)


def test_eval_writes_metrics_per_dataset(trained):
    logdir, params, lines = trained
    by_step = Controller(params, logdir, log=lines.append).evaluate()
    assert list(by_step) == [200]
    results = by_step[200]
    assert set(results) == {"dev", "test"}
    assert results["test"]["accuracy"] > 0.5  # chance is 1/8
    scalars = read_scalars(f"{logdir}/eval_test")
    assert scalars["accuracy"][0] == (200, pytest.approx(results["test"]["accuracy"], rel=1e-6))


def test_second_run_resumes_and_continues(trained):
    logdir, params, _ = trained
    more = params.copy()
    more.train.max_steps = 210
    lines = []
    Controller(more.freeze(), logdir, log=lines.append).train()
    resumed = [line for line in lines if line.startswith("resumed from")]
    assert len(resumed) == 1 and resumed[0].endswith("at step 200"), lines
    assert any(line.startswith("step 210/210") for line in lines)


def test_pipelined_experiment_writes_partition_table_and_timeline_picture(tmp_path):
    import tensorflow as tf

    logdir = str(tmp_path)
    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe", overrides="train.max_steps=3")
    logdir_lib.prepare(logdir, params)
    Controller(params, logdir, log=lambda s: None).train()
    table = open(f"{logdir}/partition.txt").read()
    assert "layer_0 .. layer_" in table and "/device:CPU:1" in table
    assert "GPipe schedule fill_drain K=2 M=4" in open(f"{logdir}/timeline.txt").read()
    image = tf.io.decode_png(open(f"{logdir}/timeline.png", "rb").read())
    assert image.shape[0] > 0 and image.shape[2] == 3
    tags, partition_text = set(), ""
    for name in (tmp_path / "train").iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(name)):
            tags.update(v.tag for v in event.summary.value)
            for v in event.summary.value:
                if v.tag == "partition":
                    partition_text += tf.make_ndarray(v.tensor).flatten()[0].decode()
    assert {"partition", "pipeline_timeline", "pipeline_timeline/classifier/network"} <= tags, tags
    # TensorBoard's partition text also carries the per-device memory plan (Adam: 2 slots per weight).
    assert "memory per device (predicted; schedule fill_drain, remat always" in partition_text, partition_text
    assert "optimizer slots 2 x weights" in partition_text, partition_text
