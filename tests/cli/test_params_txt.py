"""The trainer, for real, on what its Params come from: overrides that name a class (issue items: the same class
keeps its fields, another one resets them with a note) and a logdir's params.txt written by an earlier version or
damaged. One trained run serves every test; the variants are checked in-process (tests/training/
test_logdir_params.py, tests/hyperparams/test_hyperparams.py)."""

import os
import shutil
import sys

import pytest

from tests.helpers import tiers, trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import one_error_line

KEY = "toy.classifier.BlobsMlp"
ADAM, ADAMW = "gpipe_tf.training.optimizers.Adam", "gpipe_tf.training.optimizers.AdamW"
# Adam's beta1 set, then AdamW with its own decay (what an experiment would declare), then AdamW named again with
# a field of its own after it, as docs/trainer.md#overrides shows.
OVERRIDES = (f"train.optimizer.beta1=0.8,train.optimizer={ADAMW},train.optimizer.weight_decay=0.05,"
             f"train.optimizer.decay_exclude=bias,train.optimizer={ADAMW},train.optimizer.beta2=0.98,"
             "train.save_interval_steps=2")
ADDED = "task.softmax.label_smoothing"  # stands for a field added after the run was written


def trainer(*args):
    return trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A logdir trained 2 steps with OVERRIDES (ckpt-2), and the run's result."""
    logdir = str(tmp_path_factory.mktemp("params_txt") / "run")
    result = trainer(f"--logdir={logdir}", "--max_steps=2", f"--params={OVERRIDES}")
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir, result


@pytest.fixture
def run_copy(trained, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(trained[0], logdir)
    return logdir


def _params_lines(logdir, prefix):
    with open(os.path.join(logdir, "params.txt")) as f:
        return [line for line in f.read().splitlines() if line.startswith(prefix)]


def test_naming_the_optimizer_class_it_has_keeps_its_fields_and_another_class_says_what_it_reset(trained):
    logdir, result = trained
    # Naming AdamW again kept its decay (it trained with 0.05, not AdamW's default 0.01); Adam's beta1, set before
    # AdamW replaced Adam, was reset to AdamW's default, and one line said so.
    assert _params_lines(logdir, "train.optimizer.") == [
        "train.optimizer.name : 'adamw'", "train.optimizer.beta1 : 0.9", "train.optimizer.beta2 : 0.98",
        "train.optimizer.epsilon : 1e-08", "train.optimizer.weight_decay : 0.05",
        "train.optimizer.decay_exclude : 'bias'"]
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: --params")]
    assert notes == [f"note: --params train.optimizer={ADAMW} replaces Adam by AdamW at its defaults, so what was "
                     "set on Adam is reset: beta1=0.8 (set AdamW's fields after the class in --params)"], result.stdout


def test_a_logdir_from_a_version_without_a_defaulted_field_resumes_and_names_it(run_copy):
    # The params.txt an earlier version wrote: without the field added since (here at its default, 0.0).
    path = os.path.join(run_copy, "params.txt")
    with open(path) as f:
        lines = f.read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join(line for line in lines if not line.startswith(f"{ADDED} :")))
    result = trainer(f"--logdir={run_copy}", "--max_steps=3", f"--params={OVERRIDES}")
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stdout.splitlines() if "added since" in line]
    assert notes == [f"note: {path} lacks 1 field added since that run was written; they are taken at their "
                     f"defaults: {ADDED}=0.0"], result.stdout
    assert "resumed from" in result.stdout and "step 3/3" in result.stdout, result.stdout
    # Written anew with the field: the next resume has nothing to say.
    assert _params_lines(run_copy, f"{ADDED} :") == [f"{ADDED} : 0.0"]


def _append_byte(path):
    with open(path, "ab") as f:
        f.write(b"\xff")


def _empty(path):
    open(path, "w").close()


DAMAGES = {"not_utf8": (_append_byte, "it is not UTF-8 text (byte 0xff at offset"), "empty": (_empty, "it is empty")}
MODES = {"train": ("--max_steps=3",), "eval": ("--mode=eval", "--eval_once"), "export": ("--mode=export",)}


def _checkpoint_bytes(logdir):
    directory = os.path.join(logdir, "checkpoints")
    return {name: open(os.path.join(directory, name), "rb").read() for name in os.listdir(directory)}


@pytest.mark.parametrize("damage, mode", tiers.sample(
    [("not_utf8", "train"), ("empty", "eval"), ("not_utf8", "eval"), ("not_utf8", "export"), ("empty", "train"),
     ("empty", "export")],
    keep=[("not_utf8", "train"), ("empty", "eval")]))
def test_an_unreadable_params_txt_is_one_line_naming_it_and_the_fix_in_every_mode(run_copy, damage, mode):
    path = os.path.join(run_copy, "params.txt")
    write, reason = DAMAGES[damage]
    write(path)
    before = _checkpoint_bytes(run_copy)
    result = trainer(f"--logdir={run_copy}", *MODES[mode], f"--params={OVERRIDES}")
    line = one_error_line(result)
    assert line.startswith(f"trainer.py: error: cannot read {path}: {reason}"), line
    assert line.endswith(f"--mode=inspect_params > {path}), else use a new --logdir"), line
    assert _checkpoint_bytes(run_copy) == before and not os.path.exists(os.path.join(run_copy, "export"))
