"""Failures lose nothing: each fault is injected for real into a trainer subprocess.

A NaN batch, SIGTERM, a truncated checkpoint and a full disk (a file-size limit on the process). For each: the
message, the exit code, and that no step before the last saved checkpoint is lost.
"""

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import file_size_limit, one_error_line

KEY = "toy.classifier.BlobsMlp"
EVERY_10 = "train.save_interval_steps=10,train.log_interval_steps=1,train.max_checkpoints_to_keep=10"


def trainer(*args, preexec_fn=None):
    return trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=300, preexec_fn=preexec_fn)


def latest_step(logdir):
    return int(tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints")).rsplit("-", 1)[1])


def weights(logdir, step=None):
    ckpt_dir = os.path.join(logdir, "checkpoints")
    path = tf.train.latest_checkpoint(ckpt_dir) if step is None else os.path.join(ckpt_dir, f"ckpt-{step}")
    reader = tf.train.load_checkpoint(path)
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map() if n.startswith("task/")}


def test_nan_batch_stops_before_the_update_and_keeps_the_last_good_checkpoint(tmp_path):
    logdir = str(tmp_path)
    assert trainer(f"--logdir={logdir}", "--max_steps=20", f"--params={EVERY_10}").returncode == 0
    good = weights(logdir)
    result = trainer(f"--logdir={logdir}", "--max_steps=40", f"--params={EVERY_10},input.train.noise=float('nan')")
    line = one_error_line(result, code=1)
    # The restored iterator still holds the batches it had prefetched before the checkpoint (exact resume), so
    # the first NaN batch arrives a step or two after 20; every step before it printed a finite loss.
    bad_step = int(re.search(r"non-finite loss or gradient at step (\d+)", line).group(1))
    assert 21 <= bad_step <= 25
    logged = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(logged) == bad_step - 21 and all("loss=nan" not in line for line in logged)
    # Every non-finite gradient is named, in variable order (which of them a NaN input poisons may depend on the
    # kernels: a ReLU gradient at NaN can be 0 or NaN; fc0/w's is x^T @ dy with x NaN, so always NaN).
    names = re.search(r"in the gradients of (.+?)( and \d+ more)?; stopped", line).group(1).split(", ")
    assert "classifier/network/fc0/w" in names
    order = ["classifier/network/fc0/b", "classifier/network/fc0/w", "classifier/network/fc1/b",
             "classifier/network/fc1/w", "classifier/softmax/b", "classifier/softmax/w"]
    assert names == sorted(names, key=order.index)
    assert "ckpt-20 is the last good state" in line
    assert latest_step(logdir) == 20
    after = weights(logdir)
    assert all(np.array_equal(good[n], after[n]) for n in good)


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_trainer_faults.py::test_skipped_steps_are_counted_and_a_run_of_only_skipped_steps_fails",
))
def test_nan_steps_can_be_skipped(tmp_path):
    logdir = str(tmp_path)
    assert trainer(f"--logdir={logdir}", "--max_steps=10", f"--params={EVERY_10}").returncode == 0
    good = weights(logdir)
    result = trainer(f"--logdir={logdir}", "--max_steps=16",
                     f"--params={EVERY_10},input.train.noise=float('nan'),train.skip_nonfinite_steps=True")
    assert result.returncode == 0, result.stderr[-2000:]
    skipped = result.stdout.count("update skipped")
    assert 3 <= skipped <= 6  # the first batches after the resume were prefetched before the checkpoint
    assert latest_step(logdir) == 16
    after = weights(logdir)
    assert good.keys() == after.keys() and all(np.isfinite(v).all() for v in after.values() if v.dtype.kind == "f")


def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path):
    logdir = str(tmp_path)
    proc = trainer_process.Popen([sys.executable, "trainer.py", f"--model={KEY}", f"--logdir={logdir}",
                                  "--max_steps=1000000", f"--params={EVERY_10.replace('=10,', '=100000,', 1)}"],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    last_logged = 0
    for line in proc.stdout:
        if line.startswith("step "):
            last_logged = int(line.split()[1].split("/")[0])
            if last_logged == 30:
                proc.send_signal(signal.SIGTERM)
        if line.startswith("stopped by signal SIGTERM"):
            stopped_at = int(line.split("at step ")[1].split(";")[0])
    assert proc.wait(timeout=60) == 0
    assert stopped_at >= 30 and stopped_at == last_logged
    assert latest_step(logdir) == stopped_at  # every step up to the signal is saved


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_logdir_faults.py::test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_is_used",
))
def test_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    logdir = str(tmp_path)
    assert trainer(f"--logdir={logdir}", "--max_steps=20", f"--params={EVERY_10}").returncode == 0
    data = os.path.join(logdir, "checkpoints", "ckpt-20.data-00000-of-00001")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    result = trainer(f"--logdir={logdir}", "--max_steps=25", f"--params={EVERY_10}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "checkpoint" in result.stdout and "ckpt-20 is unreadable" in result.stdout
    assert f"resumed from {os.path.join(logdir, 'checkpoints', 'ckpt-10')} at step 10" in result.stdout
    assert latest_step(logdir) == 25


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_logdir_faults.py::test_a_rerun_on_a_full_disk_is_one_error_and_loses_no_checkpoint",
))
def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path):
    logdir = str(tmp_path)
    assert trainer(f"--logdir={logdir}", "--max_steps=10", f"--params={EVERY_10}").returncode == 0
    good = weights(logdir)
    data_size = os.path.getsize(os.path.join(logdir, "checkpoints", "ckpt-10.data-00000-of-00001"))
    result = trainer(f"--logdir={logdir}", "--max_steps=20", f"--params={EVERY_10}",
                     preexec_fn=file_size_limit(data_size // 2))
    line = one_error_line(result, code=1, only=False)  # TensorFlow warns of the failed write
    assert "could not write the checkpoint of step 20" in line and "ckpt-10 is intact" in line
    assert latest_step(logdir) == 10
    after = weights(logdir)
    assert all(np.array_equal(good[n], after[n]) for n in good)
    resumed = trainer(f"--logdir={logdir}", "--max_steps=20", f"--params={EVERY_10}")
    assert resumed.returncode == 0 and "at step 10" in resumed.stdout
