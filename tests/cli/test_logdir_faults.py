"""Faults a user can inject into a logdir, each for real: a trainer subprocess per case, real files.

Every case asserts the exit code, that the message is one `trainer.py: error:` line (or a warning naming the
damaged file), and that no checkpoint already on disk is overwritten or skipped. Two write failures need a
filesystem that refuses writes, portably and without root: a file-size limit on the child process (RLIMIT_FSIZE:
every write past it fails with EFBIG, as on a full disk), plus a read-only mode bit where the user is not root.
"""

import fcntl
import os
import re
import shutil
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.training import logdir as logdir_lib
from tests.helpers import tiers, trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import file_size_limit, one_error_line

KEY = "toy.classifier.BlobsMlp"
EVERY_10 = "train.save_interval_steps=10,train.max_checkpoints_to_keep=10"


def trainer(*args, model=KEY, preexec_fn=None):
    return trainer_process.run([sys.executable, "trainer.py", f"--model={model}", *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=300, preexec_fn=preexec_fn)


def snapshot(logdir):
    """Bytes of every checkpoint file and of params.txt: what a fault must never change."""
    out = {}
    for name in sorted(os.listdir(os.path.join(logdir, "checkpoints"))):
        if name.startswith("ckpt-"):
            with open(os.path.join(logdir, "checkpoints", name), "rb") as f:
                out[name] = f.read()
    with open(os.path.join(logdir, "params.txt"), "rb") as f:
        out["params.txt"] = f.read()
    return out


def ckpt(logdir, step):
    return os.path.join(logdir, "checkpoints", f"ckpt-{step}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A logdir with ckpt-10, ckpt-20 and ckpt-30; each test works on its own copy."""
    logdir = str(tmp_path_factory.mktemp("trained") / "run")
    result = trainer(f"--logdir={logdir}", "--max_steps=30", f"--params={EVERY_10}", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir


@pytest.fixture
def run_copy(trained, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(trained, logdir)
    return logdir


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _state_deleted(d):
    os.remove(os.path.join(d, "checkpoint"))


def _state_garbage(d):
    _write(os.path.join(d, "checkpoint"), b"\x00\xffgarbage {{")


def _state_cut(d):
    path = os.path.join(d, "checkpoint")
    _write(path, open(path, "rb").read()[:30])  # mid-line, naming no checkpoint


def _state_empty(d):
    _write(os.path.join(d, "checkpoint"), b"")


@pytest.mark.parametrize("damage", tiers.sample([_state_deleted, _state_garbage, _state_cut, _state_empty],
                                                keep=[_state_garbage], ids=["deleted", "garbage", "cut", "empty"]))
def test_a_damaged_state_file_is_named_and_training_resumes_from_the_newest_checkpoint(run_copy, damage):
    before = snapshot(run_copy)
    damage(os.path.join(run_copy, "checkpoints"))
    result = trainer(f"--logdir={run_copy}", "--max_steps=35", f"--params={EVERY_10}", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: {os.path.join(run_copy, 'checkpoints', 'checkpoint')} " in result.stdout
    assert result.stderr == ""  # that warning only: no TensorFlow log lines about the same file
    assert f"resumed from {ckpt(run_copy, 30)} at step 30" in result.stdout  # 0 steps lost
    after = snapshot(run_copy)
    assert all(after[name] == data for name, data in before.items() if name != "params.txt")
    assert tf.train.latest_checkpoint(os.path.join(run_copy, "checkpoints")) == ckpt(run_copy, 35)
    state = tf.train.get_checkpoint_state(os.path.join(run_copy, "checkpoints"))
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [f"ckpt-{s}" for s in (10, 20, 30, 35)]


def _index_truncated(d):
    path = os.path.join(d, "ckpt-30.index")
    _write(path, open(path, "rb").read()[:100])


def _index_empty(d):
    _write(os.path.join(d, "ckpt-30.index"), b"")


def _index_flipped(d):
    path = os.path.join(d, "ckpt-30.index")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    _write(path, bytes(data))


def _data_deleted(d):
    os.remove(os.path.join(d, "ckpt-30.data-00000-of-00001"))


@pytest.mark.parametrize("damage", tiers.sample([_index_truncated, _index_empty, _index_flipped, _data_deleted],
                                                keep=[_index_flipped],
                                                ids=["index-truncated", "index-empty", "index-byte-flipped",
                                                     "data-deleted"]))
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_is_used(run_copy, damage):
    damage(os.path.join(run_copy, "checkpoints"))
    before = snapshot(run_copy)
    result = trainer(f"--logdir={run_copy}", "--max_steps=25", f"--params={EVERY_10}", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: checkpoint {ckpt(run_copy, 30)} is unreadable" in result.stdout
    assert f"resumed from {ckpt(run_copy, 20)} at step 20" in result.stdout
    after = snapshot(run_copy)
    assert all(after[name] == before[name] for name in before if name.startswith(("ckpt-10", "ckpt-20")))


def test_eval_once_skips_a_damaged_newest_checkpoint(run_copy):
    _index_flipped(os.path.join(run_copy, "checkpoints"))
    result = trainer(f"--logdir={run_copy}", "--mode=eval", "--eval_once")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: checkpoint {ckpt(run_copy, 30)} is unreadable" in result.stdout
    assert re.search(r"eval dev at step 20: .*accuracy=", result.stdout), result.stdout


def test_no_restorable_checkpoint_is_one_error_and_nothing_is_written(run_copy):
    for step in (10, 20, 30):
        _write(ckpt(run_copy, step) + ".index", b"")
    listing = sorted(os.listdir(run_copy))
    before = snapshot(run_copy)
    line = one_error_line(trainer(f"--logdir={run_copy}", "--max_steps=40", f"--params={EVERY_10}"))
    assert "none of the 3 checkpoints" in line and "nothing was written" in line
    assert sorted(os.listdir(run_copy)) == listing and snapshot(run_copy) == before


def test_a_non_finite_update_is_never_saved(run_copy):
    # A learning rate of 1e39 is Inf in float32: the gradients are finite, the updated variables are not.
    result = trainer(f"--logdir={run_copy}", "--max_steps=40",
                     "--params=train.learning_rate=1e39,train.save_interval_steps=1")
    line = one_error_line(result, code=1, only=False)  # NumPy warns of the overflow first
    assert "are non-finite after the update of step 31" in line
    assert f"{ckpt(run_copy, 30)} is the last good state" in line
    ckpt_dir = os.path.join(run_copy, "checkpoints")
    assert tf.train.latest_checkpoint(ckpt_dir) == ckpt(run_copy, 30)
    reader = tf.train.load_checkpoint(ckpt(run_copy, 30))
    for name, dtype in reader.get_variable_to_dtype_map().items():
        if dtype.is_floating:
            assert np.isfinite(reader.get_tensor(name)).all(), name


def test_a_second_trainer_on_a_logdir_is_refused_and_a_killed_one_leaves_no_lock(run_copy):
    first = trainer_process.Popen([sys.executable, "trainer.py", f"--model={KEY}", f"--logdir={run_copy}",
                                   "--max_steps=1000000",
                                   "--params=train.save_interval_steps=100000,train.log_interval_steps=1"],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in first.stdout:
            if line.startswith("step "):  # it trains, so it holds the lock
                break
        line = one_error_line(trainer(f"--logdir={run_copy}", "--max_steps=40"))
        assert "is in use by another trainer" in line and f"pid {first.pid} " in line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    fd = os.open(run_copy, os.O_RDONLY)  # the kernel released the dead process's lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    result = trainer(f"--logdir={run_copy}", "--max_steps=35", f"--params={EVERY_10}", "--quiet")
    assert result.returncode == 0 and f"resumed from {ckpt(run_copy, 30)}" in result.stdout, result.stderr[-3000:]


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_logdir_faults.py::test_user_errors_are_one_line_with_exit_2_and_write_nothing",
    "tests/cli/test_trainer_cli.py::test_logdir_of_another_model_is_refused_and_left_intact",
))
def test_a_rejected_config_leaves_the_logdir_as_it_was_and_the_corrected_command_runs(tmp_path):
    logdir = str(tmp_path / "gpipe")
    gpipe = "toy.classifier.BlobsMlpGPipe"
    line = one_error_line(trainer(f"--logdir={logdir}", "--max_steps=2", "--gin_param=BlobsMlpGPipe.num_stages=8",
                                  model=gpipe))
    assert "num_stages=8" in line
    # Raised while tf.function traces the step (autograph's StagingError): unwrapped to the ParamsError.
    line = one_error_line(trainer(f"--logdir={logdir}", "--max_steps=2", "--params=input.train.batch_size=30",
                                  model=gpipe))
    assert "batch size 30 is not divisible by num_micro_batches=4" in line
    assert not os.path.exists(logdir)
    result = trainer(f"--logdir={logdir}", "--max_steps=2", "--quiet", model=gpipe)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_changed_batch_size_on_resume_is_refused_up_front(run_copy):
    before = snapshot(run_copy)
    line = one_error_line(trainer(f"--logdir={run_copy}", "--max_steps=40", "--params=input.train.batch_size=32"))
    assert "input.train.batch_size: 64 -> 32" in line and "same batch size" in line
    assert snapshot(run_copy) == before


@pytest.mark.exhaustive(covered_by=(
    "tests/pipeline/test_pipeline.py::test_checkpoints_do_not_depend_on_k_or_schedule",
    "tests/cli/test_micro_batch_resume.py::test_changing_m_of_a_model_with_dropout_warns_in_one_line",
))
def test_pipeline_layout_changes_across_resumes_match_one_uninterrupted_run(tmp_path):
    """K=2 -> K=1 -> K=4 (schedule Unrolled -> FillDrain, remat always -> never) and M=4 -> M=2: float64, no
    dropout."""
    model = "toy.classifier.BlobsMlpGPipe"
    common = ["--gin_param=BlobsMlpGPipe.dtype='float64'", "--gin_param=BlobsMlpGPipe.dropout_rate=0.0", "--quiet"]
    every_4 = "--params=train.save_interval_steps=4"
    reference = trainer(f"--logdir={tmp_path / 'ref'}", "--max_steps=12", every_4, *common, model=model)
    assert reference.returncode == 0, reference.stderr[-3000:]
    logdir = tmp_path / "changed"
    segments = [
        (4, ["--gin_param=BlobsMlpGPipe.num_stages=2", "--gin_param=BlobsMlpGPipe.num_micro_batches=4"],
         "task.network.schedule.cls=gpipe_tf.gpipe.unrolled.Unrolled"),
        (8, ["--gin_param=BlobsMlpGPipe.num_stages=1", "--gin_param=BlobsMlpGPipe.num_micro_batches=4"], None),
        (12, ["--gin_param=BlobsMlpGPipe.num_stages=4", "--gin_param=BlobsMlpGPipe.num_micro_batches=2",
              "--gin_param=BlobsMlpGPipe.remat='never'"], "task.network.schedule.parallel_iterations=2"),
    ]
    for max_steps, knobs, extra in segments:
        params = every_4 + ("," + extra if extra else "")
        result = trainer(f"--logdir={logdir}", f"--max_steps={max_steps}", params, *knobs, *common, model=model)
        assert result.returncode == 0, result.stderr[-3000:]
        if max_steps > 4:
            assert f"resumed from {logdir}/checkpoints/ckpt-{max_steps - 4}" in result.stdout
    ref = tf.train.load_checkpoint(str(tmp_path / "ref" / "checkpoints" / "ckpt-12"))
    got = tf.train.load_checkpoint(str(logdir / "checkpoints" / "ckpt-12"))
    names = [n for n, d in ref.get_variable_to_dtype_map().items() if n.startswith("task/") and d.is_floating]
    assert len(names) == 8 and set(names) <= set(got.get_variable_to_dtype_map())
    for name in names:
        np.testing.assert_allclose(got.get_tensor(name), ref.get_tensor(name), rtol=0, atol=1e-10, err_msg=name)


USER_ERRORS = [
    (["--gin_param=BlobsMlp.hidden_dims=128"], ["BlobsMlp.hidden_dims=128", "tuple or list"]),
    (["--params=train.save_interval_steps=0"], ["train.save_interval_steps=0", ">= 1"]),
    (["--mode=nonsense"], ["--mode=nonsense", "train|eval"]),
    (["--max_steps=-1"], ["--max_steps=-1"]),
    (["--logical_devices=0"], ["--logical_devices=0"]),
]


@pytest.mark.parametrize("args, fragments", tiers.sample(
    USER_ERRORS, keep=[USER_ERRORS[0], USER_ERRORS[2]],
    ids=["gin-type", "save-interval-0", "absl-enum", "max-steps-negative", "logical-devices-0"]))
def test_user_errors_are_one_line_with_exit_2_and_write_nothing(tmp_path, args, fragments):
    logdir = str(tmp_path / "run")
    line = one_error_line(trainer(f"--logdir={logdir}", *args))
    for fragment in fragments:
        assert fragment in line, line
    assert not os.path.exists(logdir)


def test_pipeline_settings_live_once_so_no_override_is_ignored():
    result = trainer("--mode=inspect_params", "--params=task.num_micro_batches=8", model="mt.number_words.NumbersTiny")
    line = one_error_line(result)
    assert "unknown param 'task.num_micro_batches'" in line
    result = trainer("--mode=inspect_params", "--params=task.network.num_micro_batches=8",
                     model="mt.number_words.NumbersTiny")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^task\.network\.num_micro_batches\s*:\s*8$", result.stdout, re.M), result.stdout[:3000]


def test_a_rerun_on_a_full_disk_is_one_error_and_loses_no_checkpoint(run_copy):
    before = {k: v for k, v in snapshot(run_copy).items() if k != "params.txt"}
    result = trainer(f"--logdir={run_copy}", "--max_steps=40", f"--params={EVERY_10}", preexec_fn=file_size_limit(100))
    line = one_error_line(result, only=False)  # AutoGraph warns it cannot write its files
    assert "cannot write" in line and "free disk space" in line
    after = snapshot(run_copy)
    assert all(after[k] == v for k, v in before.items())


def test_eval_once_on_a_read_only_logdir_is_one_error(run_copy):
    mode = os.stat(run_copy).st_mode
    os.chmod(run_copy, stat.S_IRUSR | stat.S_IXUSR)  # refuses writes where the user is not root ...
    try:  # ... and the size limit refuses them for root too
        line = one_error_line(trainer(f"--logdir={run_copy}", "--mode=eval", "--eval_once",
                                      preexec_fn=file_size_limit(100)))
    finally:
        os.chmod(run_copy, mode)
    assert "cannot write to" in line and "eval_dev" in line


def test_eval_once_without_checkpoints_is_an_error_and_creates_nothing(tmp_path):
    logdir = str(tmp_path / "mistyped")
    line = one_error_line(trainer(f"--logdir={logdir}", "--mode=eval", "--eval_once"))
    assert "no checkpoint in" in line and "check --logdir" in line
    assert not os.path.exists(logdir)


def test_eval_follow_says_what_it_waits_for(tmp_path):
    logdir = str(tmp_path / "empty")
    result = trainer(f"--logdir={logdir}", "--mode=eval", "--eval_timeout_secs=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"waiting for a new checkpoint in {logdir}/checkpoints" in result.stdout
    assert "evaluator stops" in result.stdout
    assert not os.path.exists(logdir)


def test_a_logdir_that_is_a_file_is_named_as_one_before_the_model_is_built(tmp_path):
    # Issue 35, item 16: it got "cannot write to --logdir=...: File exists; free disk space, ...".
    path = tmp_path / "run.txt"
    path.write_text("notes\n")
    line = one_error_line(trainer(f"--logdir={path}", "--max_steps=5"))
    assert line == (f"trainer.py: error: --logdir={str(path)!r} is a file, not a directory; pass the path of a "
                    f"directory (a new path, or the logdir of a run), or move {path} away")
    assert path.read_text() == "notes\n"


def test_a_directory_under_a_file_is_named_with_that_file():
    with pytest.raises(ConfigError) as raised:
        logdir_lib.check_writable(os.path.join(__file__, "eval_dev"), what="evaluation summaries")
    assert str(raised.value).startswith(f"{os.path.join(__file__, 'eval_dev')!r} (evaluation summaries) lies under "
                                        f"{__file__}, which is a file, not a directory;")
