"""trainer.py as users run it: a real subprocess per case (exit codes, messages, SIGKILL and resume)."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import assert_user_error
from tests.helpers.trainer_runs import checkpoint_values

KEY = "toy.classifier.BlobsMlp"
# Bigger than the default so a step takes milliseconds: the kill must land before the run ends.
SLOW = ["--gin_param=BlobsMlp.hidden_dims=(256, 256)", "--gin_param=BlobsMlp.batch_size=1024"]


def trainer(*args, **kwargs):
    return trainer_process.run([sys.executable, "trainer.py", *args], cwd=ROOT, capture_output=True, text=True,
                               timeout=300, **kwargs)


def test_list_models():
    result = trainer("--list_models")
    assert result.returncode == 0, result.stderr
    assert KEY in result.stdout.split()


def test_unknown_model_suggests_close_key():
    assert_user_error(trainer("--model=toy.classifier.BlobMlp", "--logdir=/tmp/x"),
                      "unknown model 'toy.classifier.BlobMlp'", "did you mean 'toy.classifier.BlobsMlp'")


def test_unknown_params_key_and_wrong_type(tmp_path):
    assert_user_error(trainer(f"--model={KEY}", f"--logdir={tmp_path}", "--params=train.learnin_rate=0.1"),
                      "train.learnin_rate", "did you mean 'train.learning_rate'")
    assert_user_error(trainer(f"--model={KEY}", f"--logdir={tmp_path}", "--params=train.learning_rate=fast"),
                      "train.learning_rate", "'fast'", "float")
    assert not os.listdir(tmp_path)


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_logdir_faults.py::test_a_logdir_that_is_a_file_is_named_as_one_before_the_model_is_built",
    "tests/cli/test_logdir_faults.py::test_a_directory_under_a_file_is_named_with_that_file",
))
def test_unwritable_logdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert_user_error(trainer(f"--model={KEY}", f"--logdir={blocker}/run", "--max_steps=1"),
                      f"--logdir='{blocker}/run' lies under {blocker}, which is a file, not a directory",
                      "pass the path of a directory")


def test_logdir_of_another_model_is_refused_and_left_intact(tmp_path):
    logdir = str(tmp_path)
    first = trainer(f"--model={KEY}", f"--logdir={logdir}", "--max_steps=2")
    assert first.returncode == 0, first.stderr
    before = checkpoint_values(logdir)
    listing = sorted(os.listdir(os.path.join(logdir, "checkpoints")))
    result = trainer(f"--model={KEY}", f"--logdir={logdir}", "--max_steps=4", "--gin_param=BlobsMlp.hidden_dims=(32,)")
    assert_user_error(result, "holds another model's run", "task.", "use a new --logdir")
    assert sorted(os.listdir(os.path.join(logdir, "checkpoints"))) == listing
    after = checkpoint_values(logdir)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_resume_after_sigkill_is_exact(tmp_path):
    common = [f"--model={KEY}", "--max_steps=100", *SLOW,
              "--params=train.save_interval_steps=20,train.log_interval_steps=1"]
    reference = trainer(*common, f"--logdir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr

    logdir = tmp_path / "killed"
    proc = trainer_process.Popen([sys.executable, "trainer.py", *common, f"--logdir={logdir}"], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 62/"):  # checkpoint 60 is written before step 61 starts
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"

    resumed = trainer(*common, f"--logdir={logdir}")
    assert resumed.returncode == 0, resumed.stderr
    first = [line for line in resumed.stdout.splitlines() if line.startswith("resumed from")]
    assert len(first) == 1 and first[0].split()[-1] in {"60", "80"}, resumed.stdout
    ref, got = checkpoint_values(tmp_path / "ref"), checkpoint_values(logdir)
    assert ref.keys() == got.keys()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], atol=1e-6, err_msg=name)


@pytest.mark.parametrize("preset, expected", [(None, "1"), ("0", "0")])
def test_trainer_turns_onednn_on_unless_the_user_chose(preset, expected):
    """oneDNN kernels are faster on CPUs where TensorFlow leaves them off (no AVX-512); a user's choice stands."""
    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    if preset is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = preset
    code = "import os, trainer; print(os.environ['TF_ENABLE_ONEDNN_OPTS'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
