"""A run says which precision it computes in: one console line when training starts and HParams columns, so a
bfloat16 and a float32 run no longer look the same."""

import subprocess
import sys

import pytest

from gpipe_tf import experiment
from gpipe_tf.training import hparams
from gpipe_tf.training.learner import Learner, describe_precision
from tests.helpers.event_files import session_hparams
from tests.helpers.paths import ROOT


@pytest.mark.parametrize("overrides, expected", [
    ("", {"weight_dtype": "float32", "compute_dtype": "float32", "loss_scale": "none"}),
    ("task.fprop_dtype=bfloat16", {"weight_dtype": "float32", "compute_dtype": "bfloat16", "loss_scale": "none"}),
    ("task.fprop_dtype=float16", {"weight_dtype": "float32", "compute_dtype": "float16",
                                  "loss_scale": "dynamic from 32768"}),
    ("task.fprop_dtype=float16,train.loss_scale.method=fixed,train.loss_scale.initial_scale=128.0",
     {"weight_dtype": "float32", "compute_dtype": "float16", "loss_scale": "fixed 128"}),
    ("task.softmax.fprop_dtype=bfloat16", {"weight_dtype": "float32", "compute_dtype": "bfloat16+float32",
                                           "loss_scale": "none"}),
])
def test_the_learner_names_its_weight_and_compute_dtypes_and_loss_scaling(overrides, expected):
    params = experiment.resolve("toy.classifier.BlobsMlp", overrides=overrides).params
    learner = Learner(params.task.instantiate(), params.train)
    assert learner.precision == expected
    assert describe_precision(learner.precision) == (
        f"precision: weights {expected['weight_dtype']}, compute {expected['compute_dtype']}, "
        f"loss scaling {expected['loss_scale']}")
    resolved = experiment.resolve("toy.classifier.BlobsMlp", overrides=overrides)
    values = hparams.hparams_of(resolved.params, resolved.knobs, learner.precision)
    assert {name: values[f"precision.{name}"] for name in expected} == expected


@pytest.mark.exhaustive(covered_by=(
    "tests/training/test_precision_visibility.py::test_the_learner_names_its_weight_and_compute_dtypes_and_loss_scaling",
))
def test_a_float16_trainer_run_prints_its_precision_and_writes_it_to_hparams(tmp_path):
    logdir = str(tmp_path / "run")
    result = subprocess.run(
        [sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe", f"--logdir={logdir}", "--max_steps=2",
         "--params=task.fprop_dtype=float16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("precision:")]
    assert lines == ["precision: weights float32, compute float16, loss scaling dynamic from 32768"], result.stdout
    values = session_hparams(logdir)
    assert values["precision.compute_dtype"] == "float16" and values["precision.loss_scale"] == "dynamic from 32768"
    assert values["precision.weight_dtype"] == "float32"
