"""Issue 24: the learning-rate schedule's end, the run seed and the trainer's faults, each for real.

User errors are trainer subprocesses on real files (as in tests/cli/test_logdir_faults.py): exit 2 and ONE line
on stderr besides TensorFlow's start-up lines (which every TF process prints before any of our code runs), no
traceback.
Cases that need a fault inside a run (a checkpoint deleted while it is read, SIGINT during the compile) inject it
with a hook at that exact point, never by timing.
"""

import math
import os
import re
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint as tf_checkpoint

from gpipe_tf import experiment
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers import base_layer
from gpipe_tf.training import checkpoints, learner, lr_schedules, run_seed
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import file_size_limit, one_error_line

M = "toy.classifier.BlobsMlp"
G = "toy.classifier.BlobsMlpGPipe"
EVERY_10 = "train.save_interval_steps=10,train.max_checkpoints_to_keep=10"


def trainer(*args, model=M, code=None):
    """Runs trainer.py (or `code`, a Python program that runs it) with `args`; the worktree is on PYTHONPATH."""
    command = [sys.executable, "trainer.py", f"--model={model}", *args] if code is None else [
        sys.executable, "-c", code, f"--model={model}", *args]
    return trainer_process.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)





def ckpt(logdir, step):
    return os.path.join(logdir, "checkpoints", f"ckpt-{step}")


def files(logdir):
    """Names and bytes of every file under logdir: what a refused command must leave unchanged."""
    out = {}
    for root, _, names in os.walk(logdir):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), logdir)] = f.read()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """M trained to step 20 (ckpt-10, ckpt-20) and G trained to step 5; tests work on copies."""
    base = tmp_path_factory.mktemp("runs")
    m, g = str(base / "m"), str(base / "g")
    result = trainer(f"--logdir={m}", "--max_steps=20", f"--params={EVERY_10}", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    result = trainer(f"--logdir={g}", "--max_steps=5", "--quiet", model=G)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"m": m, "g": g}


@pytest.fixture
def m_copy(runs, tmp_path):
    logdir = str(tmp_path / "m")
    shutil.copytree(runs["m"], logdir)
    return logdir


# --------------------------------------------------------------------------------------- one-line user errors


def test_another_models_checkpoint_is_refused_in_one_line_either_way(runs, tmp_path):
    # M's variables are a part of G's (2 of its 3 hidden layers): TensorFlow's matching alone let M evaluate it.
    line = one_error_line(trainer(f"--logdir={tmp_path / 'e1'}", "--mode=eval", f"--checkpoint={runs['g']}"))
    assert f"--checkpoint: checkpoint {ckpt(runs['g'], 5)} does not match this model" in line
    assert "classifier/network/fc2/w" in line and f"names its model {G}" in line
    # G on M's checkpoint: refused before, but with one warning line per unrestored value after the error.
    line = one_error_line(trainer(f"--logdir={tmp_path / 'e2'}", "--mode=eval", f"--checkpoint={runs['m']}", model=G))
    assert "does not match this model (it lacks classifier/network/fc2/b" in line
    assert not os.path.exists(tmp_path / "e1") and not os.path.exists(tmp_path / "e2")


def test_missing_gin_file_and_max_steps_beyond_int64_are_one_line(tmp_path):
    line = one_error_line(trainer(f"--logdir={tmp_path / 'r'}", "--gin_file=nope.gin"))
    assert line == f"trainer.py: error: --gin_file='nope.gin': no such file (relative to {ROOT}); check the path"
    line = one_error_line(trainer(f"--max_steps={2 ** 63}", "--mode=inspect_params"))
    assert f"--max_steps={2 ** 63}: {2 ** 63} is not an integer in the range [1, {2 ** 63 - 1}]" in line
    assert not os.path.exists(tmp_path / "r")


def test_train_max_steps_beyond_int64_is_refused():
    tp = learner.training_params().set(max_steps=2 ** 63)
    with pytest.raises(ParamsError, match=rf"train.max_steps={2 ** 63} is above {2 ** 63 - 1}, the largest int64"):
        learner.check_training_params(tp)


def test_init_from_rules_that_copy_nothing_and_an_unreadable_source_are_refused_before_the_logdir(runs, tmp_path):
    new = tmp_path / "new"
    rules = "[('nomatch/(.*)', '\\\\1')]"
    line = one_error_line(trainer(f"--logdir={new}", "--max_steps=3",
                             f"--params=train.init_from.checkpoint={runs['m']},train.init_from.rules={rules}"))
    assert (f"train.init_from copies none of this model's 6 variables from {ckpt(runs['m'], 20)} "
            "(rules=[('nomatch/(.*)', '\\\\1')], ignore=[]; ") in line
    assert "the source holds classifier/network/fc0/b, classifier/network/fc0/w" in line
    assert not os.path.exists(new)
    damaged = str(tmp_path / "damaged")
    shutil.copytree(runs["m"], damaged)
    with open(ckpt(damaged, 20) + ".index", "r+b") as f:
        f.truncate(10)
    line = one_error_line(trainer(f"--logdir={new}", "--max_steps=3",
                             f"--params=train.init_from.checkpoint={ckpt(damaged, 20)}"))
    assert f"train.init_from.checkpoint: checkpoint {ckpt(damaged, 20)} cannot be read" in line
    assert not os.path.exists(new)  # a rejected source leaves no (empty) logdir behind


# --------------------------------------------------------------------------------------- learning-rate end


def _cosine_params(total_steps, max_steps):
    tp = learner.training_params().set(max_steps=max_steps)
    tp.lr_schedule = lr_schedules.Cosine.params().set(total_steps=total_steps)
    return tp


def test_cosine_without_total_steps_follows_max_steps():
    schedule = lr_schedules.for_run(_cosine_params(None, 350).lr_schedule, 350)
    for step in (0, 300, 349, 350):  # the reference: the cosine formula over 350 steps
        assert float(schedule(step)) == pytest.approx(0.5 * (1 + math.cos(math.pi * step / 350)), abs=1e-7)
    assert float(schedule(349)) > 0.0


def test_cosine_shorter_than_max_steps_is_refused_naming_both_fields():
    with pytest.raises(ParamsError) as info:
        lr_schedules.for_run(_cosine_params(300, 350).lr_schedule, 350)
    assert str(info.value) == (
        "train.max_steps=350 runs past the end of the learning-rate schedule, train.lr_schedule.total_steps=300 "
        "(learning rate x 0.0 from then on); set --params=train.lr_schedule.total_steps=350, or None to follow "
        "train.max_steps")


def test_resuming_past_the_schedules_end_is_refused_before_anything_is_written(tmp_path):
    logdir = str(tmp_path / "run")

    def params(max_steps, total_steps):
        p = experiment.resolve(M, overrides=f"train.max_steps={max_steps},train.save_interval_steps=10").params.copy()
        p.train.lr_schedule = lr_schedules.Cosine.params().set(total_steps=total_steps)
        return p.freeze()

    first = params(10, 10)
    logdir_lib.prepare(logdir, first)
    Controller(first, logdir, log=lambda s: None, quiet=True).train()
    before = files(logdir)
    with pytest.raises(ParamsError, match=r"train.max_steps=15 runs past the end of the learning-rate schedule, "
                                          r"train.lr_schedule.total_steps=10 "):
        Controller(params(15, 10), logdir, log=lambda s: None, quiet=True).prepare_training()
    assert files(logdir) == before
    # Unset, the decay follows the longer run: its steps 11-15 train at a learning rate above 0.
    longer = Controller(params(15, None), logdir, log=lambda s: None, quiet=True)
    longer.train()
    assert float(longer.learner.learning_rate(tf.constant(14, tf.int64))) == pytest.approx(
        3e-3 * 0.5 * (1 + math.cos(math.pi * 14 / 15)), rel=1e-6)


# --------------------------------------------------------------------------------------- seeds


def _initial_values(params):
    return {v.name: v.numpy() for v in params.task.instantiate().variables}


def _first_batch(params):
    return next(iter(params.input.train.instantiate().dataset()))["inputs"].numpy()


def _dropout_seed(params):
    return [params.train.seed, 0]  # step 0's stateless seed (learner._train_step)


def test_the_readme_seed_example_changes_init_data_and_dropout_and_reproduces():
    default = experiment.resolve(M).params
    example = experiment.resolve(M, overrides="train.learning_rate=0.01,train.seed=3").params
    again = experiment.resolve(M, overrides="train.learning_rate=0.01,train.seed=3").params
    init, init_again, init_default = _initial_values(example), _initial_values(again), _initial_values(default)
    for name, value in init.items():
        np.testing.assert_array_equal(value, init_again[name])
    assert any(not np.array_equal(value, init_default[name]) for name, value in init.items())
    np.testing.assert_array_equal(_first_batch(example), _first_batch(again))
    assert not np.array_equal(_first_batch(example), _first_batch(default))
    assert _dropout_seed(example) != _dropout_seed(default)
    # The evaluation sets are the same for every seed; the default seed keeps the experiment's own seeds.
    assert example.input.dev.seed == default.input.dev.seed == 2
    assert default.task.seed is None and default.input.train.seed == 1
    # A seed set with --params is kept as given.
    p = experiment.resolve(M, overrides="train.seed=5,task.seed=9,input.train.seed=4").params
    assert (p.task.seed, p.input.train.seed, p.train.seed) == (9, 4, 5)
    assert run_seed._TASK_DEFAULT_SEED == base_layer.DEFAULT_SEED


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_trainer_faults.py::test_the_readme_seed_example_changes_init_data_and_dropout_and_reproduces",
))
def test_runs_with_the_same_seed_match_and_another_seed_differs_even_without_dropout(tmp_path):
    def loss(name, seed):
        result = trainer(f"--logdir={tmp_path / name}", "--max_steps=5", f"--params=train.seed={seed}",
                         "--gin_param=BlobsMlp.dropout_rate=0.0")
        assert result.returncode == 0, result.stderr[-3000:]
        return re.search(r"step 5/5 loss=(\S+)", result.stdout).group(1)

    assert loss("a", 5) == loss("b", 5) != loss("c", 1)


# --------------------------------------------------------------------------------------- faults inside a run


def test_sigint_during_the_compile_is_one_line_and_writes_no_checkpoint(tmp_path):
    # The hook raises SIGINT from inside the tracing of the train step: the compile, deterministically. The
    # program first gives SIGINT Python's default handler, as a terminal's foreground job has it: a test run
    # started in the background of a non-interactive shell (nohup ... &) inherits SIGINT ignored, and an ignored
    # SIGINT never interrupts anything.
    code = (f"import signal, sys; sys.path.insert(0, {ROOT!r}); sys.argv[0] = 'trainer.py'; import trainer\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from gpipe_tf import tf_startup; tf_startup.start_tensorflow()  # as the trainer starts TensorFlow\n"
            "from gpipe_tf.training import controller, learner\n"
            "class Interrupted(learner.Learner):\n"
            "    def _train_step(self, *args, **kwargs):\n"
            "        signal.raise_signal(signal.SIGINT)\n"
            "        return super()._train_step(*args, **kwargs)\n"
            "controller.Learner = Interrupted\n"
            "trainer.run()\n")
    logdir = tmp_path / "run"
    line = one_error_line(trainer(f"--logdir={logdir}", "--max_steps=5", code=code), code=130)
    assert line.startswith("trainer.py: error: interrupted (SIGINT) before the training loop started")
    assert not os.path.exists(logdir / "checkpoints")


def test_skipped_steps_are_counted_and_a_run_of_only_skipped_steps_fails(tmp_path):
    # Inputs of infinite noise: every step is non-finite, so every update is skipped.
    nonfinite = "train.skip_nonfinite_steps=True,input.train.noise=1e999"
    result = trainer(f"--logdir={tmp_path / 'a'}", "--max_steps=4",
                     f"--params={nonfinite},train.max_consecutive_skipped_steps=100")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: step 4/4, 4 steps, 4 of them skipped as non-finite (train.skip_nonfinite_steps)" in result.stdout
    line = one_error_line(trainer(f"--logdir={tmp_path / 'b'}", "--max_steps=30", f"--params={nonfinite}"), code=1)
    assert ("steps 1-10 were all non-finite and skipped (train.max_consecutive_skipped_steps=10; 10 of the 10 steps "
            "of this run skipped)") in line
    assert "no checkpoint is the last good state" in line
    assert not os.path.exists(ckpt(str(tmp_path / "b"), 10) + ".index")


def test_a_checkpoint_of_huge_finite_weights_is_moved_aside_and_the_rerun_resumes_before_it(m_copy):
    # ckpt-30: ckpt-20's state with every task variable times 1e29, finite (max ~1e29 < 3.4e38) and saved as good.
    params = experiment.resolve(M, overrides=EVERY_10).params
    controller = Controller(params, m_copy, log=lambda s: None, quiet=True)
    controller.restore()
    for v in controller.task.variables:
        v.assign(v * 1e29)
    controller.learner.global_step.assign(30)
    controller._save(30)
    assert np.isfinite(tf.train.load_checkpoint(ckpt(m_copy, 30)).get_tensor(
        "task/network/children/layer_0/vars/w/.ATTRIBUTES/VARIABLE_VALUE")).all()
    line = one_error_line(trainer(f"--logdir={m_copy}", "--max_steps=40", f"--params={EVERY_10}"), code=1)
    moved = os.path.join(m_copy, "checkpoints", "nonfinite")
    assert f"so {ckpt(m_copy, 20)} ({ckpt(m_copy, 30)} gave non-finite steps from its own weights on 2 batches" in line
    assert sorted(os.listdir(moved)) == ["ckpt-30.data-00000-of-00001", "ckpt-30.index"]
    rerun = trainer(f"--logdir={m_copy}", "--max_steps=40", f"--params={EVERY_10}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {ckpt(m_copy, 20)} at step 20" in rerun.stdout
    assert "warning" not in rerun.stdout  # the state file was repaired when ckpt-30 was moved
    assert tf.train.latest_checkpoint(os.path.join(m_copy, "checkpoints")) == ckpt(m_copy, 40)


def test_leftovers_of_crashed_saves_are_removed_at_start(m_copy):
    directory = os.path.join(m_copy, "checkpoints")
    os.makedirs(os.path.join(directory, "ckpt-30_temp"))
    with open(os.path.join(directory, "ckpt-30_temp", "part-00000-of-00001.data-00000-of-00001"), "wb") as f:
        f.write(b"half a checkpoint")
    with open(os.path.join(directory, "checkpoint.tmp3f2a9c"), "w") as f:
        f.write("model_checkpoint_path: \"ckpt-3")
    result = trainer(f"--logdir={m_copy}", "--max_steps=25", f"--params={EVERY_10}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"removed checkpoint.tmp3f2a9c, ckpt-30_temp from {directory}: leftovers of a save that was "
            "interrupted") in result.stdout
    assert f"resumed from {ckpt(m_copy, 20)} at step 20" in result.stdout
    assert sorted(n for n in os.listdir(directory) if "tmp" in n or "temp" in n) == []


def test_the_evaluator_reads_the_newest_when_a_checkpoint_is_rotated_away_while_it_is_read(m_copy, tmp_path,
                                                                                           monkeypatch):
    # Listed: ckpt-10 only (ckpt-20 is held back). Right before ckpt-10 is read, "the trainer" saves ckpt-20
    # and rotates ckpt-10 away (max_checkpoints_to_keep=1).
    held = tmp_path / "held"
    held.mkdir()
    directory = os.path.join(m_copy, "checkpoints")
    for name in os.listdir(directory):
        if name.startswith("ckpt-20."):
            shutil.move(os.path.join(directory, name), held / name)
    checkpoints.repair_state_file(m_copy, ckpt(m_copy, 10))  # the state file as it was when ckpt-10 was newest
    real = checkpoints.unreadable_reason

    def rotating(path):
        if path == ckpt(m_copy, 10) and os.path.exists(path + ".index"):
            for name in os.listdir(held):
                shutil.move(held / name, os.path.join(directory, name))
            for name in os.listdir(directory):
                if name.startswith("ckpt-10."):
                    os.remove(os.path.join(directory, name))
        return real(path)

    monkeypatch.setattr(checkpoints, "unreadable_reason", rotating)
    lines = []
    params = experiment.resolve(M).params
    results = Controller(params, m_copy, log=lines.append, quiet=True).evaluate(follow=False)
    assert sorted(results) == [20]
    assert not [line for line in lines if "unreadable" in line or "warning" in line], lines


# ------------------------------------------------------------------- issue 35: checkpoint faults and their words

SKIP_EVERY_5 = "train.save_interval_steps=5,train.max_checkpoints_to_keep=10,train.skip_nonfinite_steps=True"


def _save_huge_weights(logdir, step, overrides):
    """Saves checkpoint `step`: the newest state of `logdir` with every task variable times 1e29, finite (max ~1e29
    < 3.4e38) and so saved as good, from which every step is non-finite."""
    controller = Controller(experiment.resolve(M, overrides=overrides).params, logdir, log=lambda s: None, quiet=True)
    controller.restore()
    for v in controller.task.variables:
        v.assign(v * 1e29)
    controller.learner.global_step.assign(step)
    controller._save(step)


@pytest.fixture(scope="module")
def skipped_streak(runs, tmp_path_factory):
    """One trainer process for items 7, 9 and 16 of issue 35: M's run (ckpt-10, ckpt-20) with a huge-weights ckpt-25
    and the leftovers a SIGKILL leaves in best/ while the best checkpoint is written, resumed with skipped non-finite
    steps and a save every 5 steps, so steps 26-35 are skipped from ckpt-25's weights and ckpt-30 saves them again."""
    logdir = str(tmp_path_factory.mktemp("streak") / "m")
    shutil.copytree(runs["m"], logdir)
    _save_huge_weights(logdir, 25, SKIP_EVERY_5)
    best = os.path.join(logdir, "best", "checkpoints")
    os.makedirs(os.path.join(best, "ckpt-15_temp"))
    with open(os.path.join(best, "ckpt-15_temp", "part-00000-of-00001.data-00000-of-00001"), "wb") as f:
        f.write(b"half a checkpoint")
    with open(os.path.join(best, "checkpoint.tmp9c0ffee"), "w") as f:
        f.write('model_checkpoint_path: "ckpt-1')
    with open(os.path.join(logdir, "best", "best.json.tmp"), "w") as f:
        f.write('{"metric": "dev/accur')
    result = trainer(f"--logdir={logdir}", "--max_steps=40", f"--params={SKIP_EVERY_5}")
    return logdir, result


def test_a_run_of_skipped_steps_names_the_checkpoint_before_the_weights_it_failed_from(skipped_streak):
    # Issue 35, item 9: ckpt-30 was saved during the skipped steps, with ckpt-25's weights: naming ckpt-25 as the
    # last good state made the rerun fail once more.
    logdir, result = skipped_streak
    line = one_error_line(result, code=1)
    assert "steps 26-35 were all non-finite and skipped" in line
    assert f"so {ckpt(logdir, 20)} ({ckpt(logdir, 25)} and {ckpt(logdir, 30)} hold the same weights" in line
    assert sorted(os.listdir(os.path.join(logdir, "checkpoints", "nonfinite"))) == [
        "ckpt-25.data-00000-of-00001", "ckpt-25.index", "ckpt-30.data-00000-of-00001", "ckpt-30.index"]
    # The rerun resumes from the named checkpoint and trains on (in process: a trainer run is the fixture's).
    lines = []
    rerun = Controller(experiment.resolve(M, overrides=SKIP_EVERY_5 + ",train.max_steps=22").params, logdir,
                       log=lines.append)
    metrics = rerun.train()
    assert f"resumed from {ckpt(logdir, 20)} at step 20" in lines
    assert not [line for line in lines if "warning" in line], lines
    assert math.isfinite(metrics["loss"]) and metrics["nonfinite"] == 0


def test_leftovers_of_an_interrupted_best_checkpoint_save_are_removed_at_start(skipped_streak):
    # Issue 35, item 7: the start-up clean-up covered checkpoints/ only, so best/checkpoints/ckpt-N_temp/ stayed.
    logdir, result = skipped_streak
    best = os.path.join(logdir, "best")
    assert (f"removed checkpoints/checkpoint.tmp9c0ffee, checkpoints/ckpt-15_temp, best.json.tmp from {best}: "
            "leftovers of a save of the best checkpoint that was interrupted") in result.stdout
    assert os.listdir(os.path.join(best, "checkpoints")) == [] and os.listdir(best) == ["checkpoints"]


def test_the_skipped_step_warning_reads_as_the_error_does(skipped_streak):
    # Issue 35, item 16: it read "warning: non-finite the gradients of ...".
    _, result = skipped_streak
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 9, result.stdout[-3000:]  # steps 26-34; the 10th in a row is the error
    assert warnings[0].startswith("warning: non-finite loss or gradient at step 26, in the ")
    assert warnings[0].endswith("; update skipped (train.skip_nonfinite_steps)")
    assert not [line for line in warnings if "non-finite the" in line]


def test_a_checkpoint_write_error_keeps_its_cause(m_copy):
    # Issue 35, item 13: the message was cut at 200 characters, spent on TensorFlow's function name and the temp
    # path, so "File too large" was lost. A file-size limit on the process fails the write of ckpt-21.
    data_size = os.path.getsize(ckpt(m_copy, 20) + ".data-00000-of-00001")
    result = trainer_process.run([sys.executable, "trainer.py", f"--model={M}", f"--logdir={m_copy}", "--max_steps=21",
                                  f"--params={EVERY_10}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                                 preexec_fn=file_size_limit(data_size // 2))
    line = one_error_line(result, code=1, only=False)  # TensorFlow warns of the failed write
    directory = os.path.join(m_copy, "checkpoints")
    assert (f"could not write the checkpoint of step 21 to {directory} (ckpt-21_temp/part-00000-of-00001"
            f".data-00000-of-00001; File too large); the previous checkpoint {ckpt(m_copy, 20)} is intact") in line
    assert "function_node" not in line and "tempstate" not in line and "[Op:" not in line


def test_a_checkpoint_rotated_away_while_restored_leaves_the_next_one_readable(m_copy, monkeypatch):
    # Issue 35, item 15: an evaluator beside a trainer that keeps 2 checkpoints. Right after TensorFlow's restore
    # opened ckpt-10, "the trainer" rotates ckpt-10 away (TensorFlow deletes the index first): the restore fails, and
    # the evaluator reported the healthy ckpt-20 as unreadable with ckpt-10's error, as the restore cut short had
    # left a restoration of ckpt-10 pending in the evaluator's checkpoint object.
    real = tf_checkpoint.py_checkpoint_reader

    class Rotating:
        @staticmethod
        def NewCheckpointReader(path):  # noqa: N802 -- TensorFlow's name
            reader = real.NewCheckpointReader(path)
            if path == ckpt(m_copy, 10) and os.path.exists(path + ".index"):
                os.remove(path + ".index")
            return reader

    monkeypatch.setattr(tf_checkpoint, "py_checkpoint_reader", Rotating)
    with open(os.path.join(m_copy, "TRAINING_DONE"), "w") as f:
        f.write("20\n")
    lines = []
    results = Controller(experiment.resolve(M).params, m_copy, log=lines.append, quiet=True).evaluate(
        follow=True, poll_secs=0, timeout_secs=60)
    assert sorted(results) == [20]
    assert not [line for line in lines if "unreadable" in line or "warning" in line], lines
