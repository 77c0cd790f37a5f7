"""Jobs around training: an evaluator process beside the trainer, train_and_eval, inspect, profiling, --quiet."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from gpipe_tf.training.summaries import read_scalars
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT

KEY = "toy.classifier.BlobsMlp"


def trainer_cmd(*args):
    return [sys.executable, "trainer.py", f"--model={KEY}", *args]


def run(*args):
    return trainer_process.run(trainer_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_evaluator_beside_trainer_evaluates_every_checkpoint_exactly_once(tmp_path):
    logdir = str(tmp_path)
    evaluator = trainer_process.Popen(trainer_cmd(f"--logdir={logdir}", "--mode=eval", "--eval_timeout_secs=120"),
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trained = run(f"--logdir={logdir}", "--max_steps=60",
                  "--params=train.save_interval_steps=10,train.max_checkpoints_to_keep=10")
    assert trained.returncode == 0, trained.stderr[-2000:]
    out, err = evaluator.communicate(timeout=180)
    assert evaluator.returncode == 0, err[-2000:]
    for name in ("dev", "test"):
        steps = [step for step, _ in read_scalars(os.path.join(logdir, f"eval_{name}"))["accuracy"]]
        assert sorted(steps) == [10, 20, 30, 40, 50, 60], steps
    # The evaluator only reads: the trainer's checkpoint list is what the trainer wrote.
    ckpts = tf.train.get_checkpoint_state(os.path.join(logdir, "checkpoints")).all_model_checkpoint_paths
    assert [int(p.rsplit("-", 1)[1]) for p in ckpts] == [10, 20, 30, 40, 50, 60]


def test_train_and_eval_eval_once_quiet_and_profile(tmp_path):
    logdir = str(tmp_path)
    result = run(f"--logdir={logdir}", "--mode=train_and_eval", "--max_steps=20", "--quiet", "--profile_steps=5,8",
                 "--params=train.eval_interval_steps=10")
    assert result.returncode == 0, result.stderr[-2000:]
    assert not [line for line in result.stdout.splitlines() if line.startswith("step ")]  # --quiet
    assert [step for step, _ in read_scalars(os.path.join(logdir, "eval_dev"))["loss"]] == [10, 20]
    profiles = [f for _, _, files in os.walk(os.path.join(logdir, "plugins", "profile")) for f in files]
    assert any(f.endswith(".xplane.pb") for f in profiles), profiles
    scalars = read_scalars(os.path.join(logdir, "train"))
    assert {"var_norm", "step_time", "loss"} <= set(scalars)
    once = run(f"--logdir={logdir}", "--mode=eval", "--eval_once")
    assert once.returncode == 0 and "eval dev at step 20" in once.stdout


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_progress.py::test_inspect_progress_goes_to_stderr_and_json_stays_parseable",
))
def test_inspect_from_params_alone_prints_json():
    result = run("--mode=inspect", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model"] == KEY and report["total_params"] == 16 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8
    piped = trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe", "--mode=inspect",
                                 "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = json.loads(piped.stdout.strip().splitlines()[-1])
    assert [s["params"] for s in report["stages"]] == [16 * 64 + 64 + 64 * 64 + 64, 64 * 64 + 64]
    assert all(s["activation_bytes_estimate"] > 0 for s in report["stages"])
    assert sum(s["params"] for s in report["stages"]) + 64 * 8 + 8 == report["total_params"]


def test_decode_on_a_classifier_is_a_clear_error():
    result = run("--mode=decode", "--logdir=/tmp/unused")
    assert result.returncode == 2 and "has no decode step" in result.stderr
