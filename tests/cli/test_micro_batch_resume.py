"""Changing M (num_micro_batches) on resume: loss and gradients do not depend on M, but dropout masks (drawn per
micro-batch from the step's seed folded with the micro-batch index) and batch-norm statistics (per micro-batch)
do. A resume that changes M of such a task says so in one warning line; nothing else changes silently."""

import os
import sys

import pytest

from gpipe_tf import experiment
from gpipe_tf.training import logdir as logdir_lib
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT

KEY = "toy.classifier.BlobsMlpGPipe"


def _logdir_with_checkpoint(tmp_path, params):
    logdir = str(tmp_path / "run")
    os.makedirs(os.path.join(logdir, "checkpoints"))
    open(os.path.join(logdir, "checkpoints", "ckpt-2.index"), "w").close()
    logdir_lib.write_params(logdir, params)
    return logdir


def _params(key=KEY, *bindings):
    return experiment.resolve(key, gin_bindings=list(bindings)).params


def _warnings(logdir, params):
    return logdir_lib.resume_warnings(logdir, params, params.task.instantiate())


def test_changing_m_of_a_model_with_dropout_warns_in_one_line(tmp_path):
    logdir = _logdir_with_checkpoint(tmp_path, _params())
    warnings = _warnings(logdir, _params(KEY, "BlobsMlpGPipe.num_micro_batches=2"))
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("warning: resuming with task.network.num_micro_batches 4 -> 2: dropout masks "
                                  "depend on the split into micro-batches")
    assert "batch-norm" not in warnings[0]


@pytest.mark.parametrize("old, new", [
    ((), ()),  # M unchanged
    (("BlobsMlpGPipe.dropout_rate=0.0",), ("BlobsMlpGPipe.dropout_rate=0.0", "BlobsMlpGPipe.num_micro_batches=2")),
])
def test_no_warning_when_m_is_unchanged_or_the_model_draws_nothing_per_micro_batch(tmp_path, old, new):
    logdir = _logdir_with_checkpoint(tmp_path, _params(KEY, *old))
    assert _warnings(logdir, _params(KEY, *new)) == []


def test_no_warning_for_a_new_run(tmp_path):
    assert _warnings(str(tmp_path / "new"), _params()) == []


def test_batch_norm_statistics_are_named_too(tmp_path):
    key = "image.amoebanet.AmoebaNetTinyOffline"
    name = key.rsplit(".", 1)[1]
    logdir = _logdir_with_checkpoint(tmp_path, _params(key, f"{name}.dropout_rate=0.0"))
    warnings = _warnings(logdir, _params(key, f"{name}.dropout_rate=0.0", f"{name}.num_micro_batches=2"))
    assert len(warnings) == 1 and "batch-norm statistics depend on the split" in warnings[0], warnings
    assert "dropout" not in warnings[0]


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_micro_batch_resume.py::test_changing_m_of_a_model_with_dropout_warns_in_one_line",
))
def test_a_trainer_resume_with_another_m_prints_the_warning_once(tmp_path):
    logdir = str(tmp_path / "run")

    def run(*args):
        return trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", f"--logdir={logdir}", "--quiet",
                                    *args], cwd=ROOT, capture_output=True, text=True, timeout=300)

    first = run("--max_steps=2")
    assert first.returncode == 0 and "warning" not in first.stdout, first.stderr[-3000:]
    second = run("--max_steps=3", "--gin_param=BlobsMlpGPipe.num_micro_batches=2")
    assert second.returncode == 0, second.stderr[-3000:]
    warnings = [line for line in second.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "num_micro_batches 4 -> 2: dropout masks" in warnings[0], second.stdout
