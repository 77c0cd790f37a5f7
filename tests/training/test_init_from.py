"""train.init_from (fine-tuning) and --checkpoint for eval: a new head on a trained body, rules, errors."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training import init_from
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT

KEY = "toy.classifier.BlobsMlp"
BODY = ["classifier/network/fc0/w", "classifier/network/fc0/b", "classifier/network/fc1/w", "classifier/network/fc1/b"]
HEAD = ["classifier/softmax/w", "classifier/softmax/b"]
# Checkpoint keys of the body's variables (layer_0 and layer_2 of the Sequential: the dropouts are layers 1 and 3).
BODY_KEYS = {f"classifier/network/fc{i}/{v}": f"task/network/children/layer_{2 * i}/vars/{v}/.ATTRIBUTES/VARIABLE_VALUE"
             for i in (0, 1) for v in ("w", "b")}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A BlobsMlp (8 classes) trained 20 steps: the run to fine-tune from."""
    logdir = str(tmp_path_factory.mktemp("source"))
    params, _ = experiment.resolve_params(KEY, overrides="train.max_steps=20")
    logdir_lib.prepare(logdir, params)
    Controller(params, logdir, log=lambda s: None).train()
    return logdir


def values(controller):
    return {v.name.rsplit(":", 1)[0]: v.numpy() for v in controller.task.variables}


def test_new_head_fine_tunes_from_the_trained_body_once(source, tmp_path):
    logdir = str(tmp_path / "finetune")
    params, _ = experiment.resolve_params(KEY, gin_bindings=["BlobsMlp.num_classes = 4"],
                                          overrides=f"train.max_steps=5,train.init_from.checkpoint='{source}'")
    logdir_lib.prepare(logdir, params)
    lines = []
    controller = Controller(params, logdir, log=lines.append)
    controller.restore()
    got = values(controller)
    reader = tf.train.load_checkpoint(os.path.join(source, "checkpoints", "ckpt-20"))
    for name in BODY:
        np.testing.assert_array_equal(got[name], reader.get_tensor(BODY_KEYS[name]), err_msg=name)
    fresh = {v.name.rsplit(":", 1)[0]: v.numpy() for v in params.task.instantiate().variables}
    for name in HEAD:  # the new head keeps its initial values
        np.testing.assert_array_equal(got[name], fresh[name], err_msg=name)
    assert int(controller.learner.global_step.numpy()) == 0
    source_ckpt = os.path.join(source, "checkpoints", "ckpt-20")
    assert f"initialized 4 of 6 variables from {source_ckpt} (train.init_from)" in lines
    assert ("init_from: another shape in the source checkpoint, left as initialized: classifier/softmax/b [4] "
            "(source [8]), classifier/softmax/w [64, 4] (source [64, 8])") in lines

    controller.train()  # fine-tunes to step 5 and saves ckpt-5
    resumed_lines = []
    more, _ = experiment.resolve_params(KEY, gin_bindings=["BlobsMlp.num_classes = 4"],
                                        overrides=f"train.max_steps=6,train.init_from.checkpoint='{source}'")
    resumed = Controller(more, logdir, log=resumed_lines.append)
    resumed.restore()
    # A resumed run restores its own checkpoint and never reads the source again; one line says so.
    own = os.path.join(logdir, "checkpoints", "ckpt-5")
    assert [line for line in resumed_lines if "init_from" in line] == [
        f"train.init_from.checkpoint={source!r} not applied: the run resumes from its own {own} (init_from starts "
        "only a new run; use a new --logdir to start from it)"], resumed_lines
    mine = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints", "ckpt-5"))
    now = values(resumed)
    for name in BODY:
        np.testing.assert_array_equal(now[name], mine.get_tensor(BODY_KEYS[name]), err_msg=name)
        assert not np.array_equal(now[name], reader.get_tensor(BODY_KEYS[name])), name


def test_rules_rename_ignore_and_list_what_is_not_copied():
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in
                 [("new/body/w", [2, 3]), ("new/body/b", [3]), ("new/head/w", [3, 4]), ("new/extra/w", [1]),
                  ("other/w", [5])]]
    source = {"old/body/w": ("k1", [2, 3]), "old/body/b": ("k2", [3]), "old/head/w": ("k3", [3, 4])}
    p = init_from.init_from_params().set(checkpoint="unused", rules=[("new/(body|extra)/(.*)", "old/\\1/\\2"),
                                                                     ("new/(.*)", "old/\\1")],
                                         ignore=["new/head/.*"])
    result = init_from.plan(variables, source, p)
    assert [(v.name, src, key) for v, src, key in result.copies] == [("new/body/w:0", "old/body/w", "k1"),
                                                                      ("new/body/b:0", "old/body/b", "k2")]
    assert result.ignored == ["new/head/w"] and result.no_rule == ["other/w"]
    assert result.not_in_source == [("new/extra/w", "old/extra/w")] and result.shape_mismatch == []
    lines = init_from.describe(result, "/ckpt-3", len(variables))
    assert lines == ["initialized 2 of 5 variables from /ckpt-3 (train.init_from)",
                     "init_from: matched by no rule, left as initialized: other/w",
                     "init_from: ignored (train.init_from.ignore), left as initialized: new/head/w",
                     "init_from: not in the source checkpoint, left as initialized: new/extra/w (looked for "
                     "old/extra/w)"]


def test_malformed_rules_name_the_field():
    p = init_from.init_from_params()
    with pytest.raises(ParamsError, match=r"train.init_from.rules\[0\]: '\(unclosed' is not a regular expression"):
        init_from.check(p.copy().set(rules=[("(unclosed", "x")]))
    with pytest.raises(ParamsError, match=r"train.init_from.rules\[0\]=\('only one',\) must be a \(regex, "):
        init_from.check(p.copy().set(rules=[("only one",)]))


def trainer(*args):
    return trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)


def test_missing_source_is_refused_before_the_logdir_is_touched(tmp_path):
    missing = str(tmp_path / "no_such_run")
    result = trainer(f"--logdir={tmp_path / 'new'}", "--max_steps=2",
                     f"--params=train.init_from.checkpoint='{missing}'")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"trainer.py: error: train.init_from.checkpoint='{missing}' names no checkpoint: {missing}.index does "
            "not exist") in result.stderr
    assert not os.path.exists(tmp_path / "new")


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_trainer_faults.py::test_another_models_checkpoint_is_refused_in_one_line_either_way",
    "tests/cli/test_logdir_faults.py::test_eval_once_skips_a_damaged_newest_checkpoint",
))
def test_eval_of_a_chosen_checkpoint_and_clear_errors(source, tmp_path):
    logdir = str(tmp_path / "run")
    assert trainer(f"--logdir={logdir}", "--max_steps=20", "--quiet",
                   "--params=train.save_interval_steps=10").returncode == 0
    chosen = os.path.join(logdir, "checkpoints", "ckpt-10")
    result = trainer(f"--logdir={logdir}", "--mode=eval", f"--checkpoint={chosen}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"evaluating {chosen}" in result.stdout and "eval dev at step 10: accuracy=" in result.stdout
    assert "at step 20" not in result.stdout  # the newest is not evaluated
    # Unreadable: a truncated index file names the checkpoint.
    damaged = os.path.join(logdir, "checkpoints", "ckpt-20")
    with open(damaged + ".index", "r+b") as f:
        f.truncate(10)
    result = trainer(f"--logdir={logdir}", "--mode=eval", f"--checkpoint={damaged}")
    assert result.returncode == 2 and f"--checkpoint: checkpoint {damaged} cannot be read" in result.stderr
    # Another model's checkpoint (a 4-class head) is refused, not evaluated with mismatched weights.
    result = trainer(f"--logdir={tmp_path / 'other'}", "--mode=eval", f"--checkpoint={source}",
                     "--gin_param=BlobsMlp.num_classes=4")
    assert result.returncode == 2 and "does not match this model" in result.stderr
    result = trainer(f"--logdir={logdir}", "--max_steps=30", f"--checkpoint={chosen}")
    assert result.returncode == 2 and "use --params=train.init_from.checkpoint=PATH" in result.stderr
