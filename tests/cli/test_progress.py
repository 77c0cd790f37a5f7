"""Progress lines: compile time, ETA from steady-state steps, checkpoints, done, eval/decode/inspect phases, --quiet.

Times come from a fake clock that the test advances, so no assert depends on the machine's speed.
"""

import json
import re
import sys

import pytest

from gpipe_tf import experiment
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training import progress
from gpipe_tf.training.controller import Controller
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT

KEY = "toy.classifier.BlobsMlp"


class FakeClock:
    """A clock that moves only when told to (or by `tick` seconds per reading)."""

    def __init__(self, tick=0.0):
        self.now, self.tick = 0.0, tick

    def __call__(self):
        self.now += self.tick
        return self.now


def controller(logdir, overrides, lines, clock, quiet=False):
    params, _ = experiment.resolve_params(KEY, overrides=overrides)
    logdir_lib.prepare(logdir, params)
    return Controller(params, logdir, log=lines.append, quiet=quiet, clock=clock)


def test_eta_excludes_the_compiling_first_step_and_checkpoints_and_done_are_reported(tmp_path):
    lines, clock = [], FakeClock()
    c = controller(str(tmp_path), "train.max_steps=10,train.log_interval_steps=5,train.save_interval_steps=5",
                   lines, clock)
    c.prepare_training()
    step = c.learner.train_step

    def timed_step(*args):  # the first step "compiles" for 100 s, every later one takes 1 s
        clock.now += 100.0 if clock.now == 0.0 else 1.0
        return step(*args)

    c.learner.train_step = timed_step
    c.train()
    assert lines[0] == "precision: weights float32, compute float32, loss scaling none"
    assert lines[1] == "compiling the train step ..."
    assert lines[2] == ("train step compiled in 1m40s (tracing 0.0s, first step 1m40s); rate and ETA from the "
                        "steps after it")
    by_step = {m.group(1): line for line in lines if (m := re.match(r"step (\d+)/10 ", line))}
    # Steps 2..5 took 4 s: 1 step/s, so 5 steps remain for 5 s (counting the compile it would say 1m44s).
    assert by_step["5"].endswith("examples/sec=64.0 eta=5s"), by_step["5"]
    assert by_step["10"].endswith("examples/sec=64.0 eta=0s"), by_step["10"]
    saved = [line for line in lines if line.startswith("saved checkpoint ")]
    assert saved == [f"saved checkpoint {tmp_path}/checkpoints/ckpt-{n}" for n in (5, 10)]
    assert lines[-1] == (f"done: step 10/10, 10 steps in 1m49s (compilation included); last checkpoint "
                         f"{tmp_path}/checkpoints/ckpt-10")


def test_a_log_at_the_compiling_step_shows_no_rate(tmp_path):
    lines = []
    controller(str(tmp_path), "train.max_steps=2,train.log_interval_steps=1", lines, FakeClock()).train()
    first = next(line for line in lines if line.startswith("step 1/2 "))
    assert first.endswith("examples/sec=? eta=?"), first


def test_quiet_prints_nothing_for_a_clean_run(tmp_path):
    lines = []
    controller(str(tmp_path), "train.max_steps=10,train.save_interval_steps=5", lines, FakeClock(), quiet=True).train()
    assert lines == []


def test_eval_reports_batches_at_most_every_interval(tmp_path):
    lines = []
    params, _ = experiment.resolve_params(KEY, overrides="train.max_steps=1,eval.datasets=['dev']")
    logdir_lib.prepare(str(tmp_path), params)
    Controller(params, str(tmp_path), log=lambda s: None).train()
    # Each reading of the clock is 4 s later: a line every third batch (12 s >= the 10 s interval).
    Controller(params, str(tmp_path), log=lines.append, clock=FakeClock(tick=4.0)).evaluate()
    assert lines[0] == "eval dev at step 1: 20 batches ..."
    assert [line for line in lines if "/20 batches" in line][:2] == ["eval dev at step 1: 3/20 batches, 12s",
                                                                     "eval dev at step 1: 6/20 batches, 24s"]
    assert re.fullmatch(r"eval dev at step 1: accuracy=\S+ loss=\S+ \(1m24s\)", lines[-1]), lines[-1]


def test_phase_lines_and_durations():
    lines, clock = [], FakeClock()
    phase = progress.Phase(lines.append, "decode test at step 3", None, unit="batches", clock=clock)
    for n, t in enumerate([5.0, 11.0, 15.0, 30.0], start=1):
        clock.now = t
        phase.update(n)
    clock.now = 3725.0
    assert phase.finish() == 3725.0
    assert lines == ["decode test at step 3: ? batches ...", "decode test at step 3: 2/? batches, 11s",
                     "decode test at step 3: 4/? batches, 30s"]
    assert [progress.format_duration(s) for s in (0.04, 9.94, 59.6, 61, 3725)] == ["0.0s", "9.9s", "1m00s", "1m01s",
                                                                                  "1h02m05s"]


def trainer(*args):
    return trainer_process.run([sys.executable, "trainer.py", *args], cwd=ROOT, capture_output=True, text=True,
                               timeout=300)


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_progress.py::test_eta_excludes_the_compiling_first_step_and_checkpoints_and_done_are_reported",
    "tests/cli/test_progress.py::test_quiet_prints_nothing_for_a_clean_run",
))
def test_trainer_prints_compile_checkpoint_and_done_lines_and_quiet_silences_them(tmp_path):
    result = trainer(f"--model={KEY}", f"--logdir={tmp_path / 'loud'}", "--max_steps=20",
                     "--params=train.save_interval_steps=10,train.log_interval_steps=10")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    assert out[0] == "precision: weights float32, compute float32, loss scaling none"
    assert out[1] == "compiling the train step ..." and out[2].startswith("train step compiled in ")
    assert [line.split()[0:2] for line in out[3:]] == [["step", "10/20"], ["saved", "checkpoint"], ["step", "20/20"],
                                                      ["saved", "checkpoint"], ["done:", "step"]], out
    quiet = trainer(f"--model={KEY}", f"--logdir={tmp_path / 'quiet'}", "--max_steps=20", "--quiet")
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout


def test_inspect_progress_goes_to_stderr_and_json_stays_parseable():
    result = trainer("--model=toy.classifier.BlobsMlpGPipe", "--mode=inspect", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["total_params"] > 0
    assert ("inspecting toy.classifier.BlobsMlpGPipe from its Params (task.network: K=2 stages over 6 layers, "
            "balance_by=params) ...") in result.stderr
    assert re.search(r"^inspect done in \S+s$", result.stderr, re.M), result.stderr[-2000:]
    quiet = trainer("--model=toy.classifier.BlobsMlpGPipe", "--mode=inspect", "--quiet")
    assert quiet.returncode == 0 and "inspect" not in quiet.stderr and quiet.stdout.startswith("model ")
