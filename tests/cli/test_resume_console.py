"""What real trainer processes print around a resume: only what is true, in one line each.

One run is made once for the module (train_and_eval with weight averages and keep-best on dev/loss), then resumed with
a cut state file, and resumed with another optimizer; each test reads one of those processes:

- keep-best on a loss metric keeps the lowest value and says so (issue 35, item 2);
- a resume with another optimizer's slots is one line naming both optimizers and the way on (item 10);
- a resume with weight averages and a cut state file prints no TensorFlow log lines (item 14): the averages restore
  exactly and the damaged state file has its own warning;
- float16 gradients that underflow to zero are named in a warning (item 17).
"""

import json
import os
import re
import sys

import numpy as np
import pytest

from gpipe_tf.training.summaries import read_scalars
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import one_error_line

KEY = "toy.classifier.BlobsMlp"
SETTINGS = ("train.ema_decay=0.5,train.keep_best_metric=dev/loss,train.eval_interval_steps=5,"
            "train.save_interval_steps=5,train.max_checkpoints_to_keep=10")
# A line of TensorFlow's Python logging (absl's handler: "WARNING:absl:...", or "W1127 12:00:00.000 ... ]").
LOG_LINE = re.compile(r"^(?:[A-Z]+:(?:absl|tensorflow):|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.py:\d+\])")


def trainer(*args):
    return trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)


def log_lines(result):
    return [line for line in (result.stdout + result.stderr).splitlines() if LOG_LINE.match(line)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The processes of one run, in order: trained to 20, resumed to 25 after its state file was cut, and resumed
    with Adafactor."""
    logdir = str(tmp_path_factory.mktemp("run") / "run")
    out = {"logdir": logdir}
    out["trained"] = trainer(f"--logdir={logdir}", "--mode=train_and_eval", "--max_steps=20", f"--params={SETTINGS}")
    state = os.path.join(logdir, "checkpoints", "checkpoint")
    with open(state, "rb") as f:
        text = f.read()
    with open(state, "wb") as f:
        f.write(text[:30])  # mid-line, naming no checkpoint
    out["resumed"] = trainer(f"--logdir={logdir}", "--max_steps=25", f"--params={SETTINGS}")
    out["other_optimizer"] = trainer(f"--logdir={logdir}", "--max_steps=30",
                                     f"--params={SETTINGS},train.optimizer=gpipe_tf.training.adafactor.Adafactor")
    return out


def test_keep_best_on_a_loss_keeps_the_lowest_and_says_so(runs):
    result, logdir = runs["trained"], runs["logdir"]
    assert result.returncode == 0, result.stderr[-3000:]
    steps, losses = zip(*read_scalars(os.path.join(logdir, "eval_dev"))["loss"])
    lowest, highest = steps[int(np.argmin(losses))], steps[int(np.argmax(losses))]
    assert lowest != highest
    with open(os.path.join(logdir, "best", "best.json"), encoding="utf-8") as f:
        record = json.load(f)
    assert (record["metric"], record["mode"], record["step"]) == ("dev/loss", "min", lowest)
    assert sorted(n for n in os.listdir(os.path.join(logdir, "best", "checkpoints")) if n.endswith(".index")) == [
        f"ckpt-{lowest}.index"]
    assert (f"keep-best: the checkpoint of the lowest dev/loss is kept in {logdir}/best (train.keep_best_mode=auto "
            "chose min: the metric's name says lower is better; set train.keep_best_mode=max for the other way)"
            in result.stdout.splitlines())


def test_a_resume_with_averages_and_a_cut_state_file_prints_no_tensorflow_log_lines(runs):
    result, logdir = runs["resumed"], runs["logdir"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {logdir}/checkpoints/ckpt-20 at step 20" in result.stdout
    state = os.path.join(logdir, "checkpoints", "checkpoint")
    assert (f"warning: {state} cannot be parsed (empty, cut or garbage); using the checkpoint files found in "
            f"{logdir}/checkpoints") in result.stdout.splitlines()
    assert log_lines(result) == [], result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]


def test_a_resume_with_another_optimizer_is_one_line_naming_both_and_the_way_on(runs):
    result, logdir = runs["other_optimizer"], runs["logdir"]
    path = f"{logdir}/checkpoints/ckpt-25"
    assert one_error_line(result) == (
        f"trainer.py: error: checkpoint {path} holds the slots of optimizer adam (m, v), this run's optimizer "
        "adafactor keeps others (v): the optimizer's slots differ from the checkpoint's, so its state cannot continue "
        f"here; resume with the run's own optimizer (adam: train.optimizer as in {logdir}/params.txt), or start a new "
        f"run from these weights with adafactor: a new --logdir and --params=train.init_from.checkpoint={path} (a "
        "fine-tune: docs/fine_tuning.md#another-optimizer)")
    with open(os.path.join(logdir, "params.txt"), encoding="utf-8") as f:
        assert "gpipe_tf.training.optimizers.Adam)" in f.read()  # the refused command changed nothing


def test_float16_gradients_that_underflow_are_named_with_the_fix(tmp_path):
    # A fixed loss scale of 1e-9 makes every float16 gradient underflow: the loss times it is differentiated in
    # float16, where magnitudes below 6e-8 are zero.
    result = trainer_process.run(
        [sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe", f"--logdir={tmp_path}",
         "--max_steps=6", "--params=task.fprop_dtype=float16,train.loss_scale.method=fixed,"
         "train.loss_scale.initial_scale=1e-9,train.loss_scale.min_scale=1e-9"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: every gradient")]
    fix = ("was exactly zero in steps 1-5 (5 in a row), so its weights do not train: its float16 gradients underflow "
           "(magnitudes below 6e-8 round to zero) at the fixed loss scale 1e-09: raise train.loss_scale.initial_scale, "
           "or set train.loss_scale.method=dynamic (docs/precision.md#float16-and-loss-scaling)")
    net = "classifier/network"
    assert warnings == [
        f"warning: every gradient of stage 0 of {net} ({net}/fc0/b, {net}/fc0/w and 2 more) {fix}",
        f"warning: every gradient of stage 1 of {net} ({net}/fc2/b, {net}/fc2/w) {fix}"]
