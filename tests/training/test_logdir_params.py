"""A logdir's params.txt read on resume, eval and export: fields added since a run was written, real differences,
and a file that cannot be read (checked in-process; tests/cli/test_params_txt.py runs the trainer on them)."""

import os
import re

import pytest

from gpipe_tf import experiment
from gpipe_tf.errors import ConfigError
from gpipe_tf.training import logdir as logdir_lib

KEY = "toy.classifier.BlobsMlp"
ADDED = "task.softmax.label_smoothing"  # stands for a field added after the run was written


def _logdir(tmp_path, params, drop=()):
    """A logdir with a checkpoint and the params.txt of `params`, without the lines of the fields in `drop`: the
    params.txt an earlier version, which lacked those fields, wrote."""
    logdir = str(tmp_path / "run")
    os.makedirs(os.path.join(logdir, "checkpoints"))
    open(os.path.join(logdir, "checkpoints", "ckpt-10.index"), "w").close()  # only its name is read here
    lines = [line for line in params.to_text().splitlines() if line.split(" : ")[0] not in drop
             and not line.startswith(tuple(f"{field}." for field in drop))]
    with open(os.path.join(logdir, "params.txt"), "w") as f:
        f.write("\n".join(lines))
    return logdir


def test_fields_added_since_at_their_defaults_are_accepted_and_named_in_one_note(tmp_path):
    params = experiment.resolve(KEY).params
    # A leaf, and a whole node (Params) whose fields are all at the defaults of the class holding it.
    logdir = _logdir(tmp_path, params, drop=(ADDED, "task.params_init"))
    path = os.path.join(logdir, "params.txt")
    assert logdir_lib.check_compatible(logdir, params, training=True) == [
        f"note: {path} lacks 2 fields added since that run was written; they are taken at their defaults: "
        "task.params_init=Params(), task.softmax.label_smoothing=0.0"]
    # Same Params on both sides: nothing to say.
    logdir_lib.write_params(logdir, params)
    assert logdir_lib.check_compatible(logdir, params, training=True) == []


def test_an_added_field_away_from_its_default_and_a_changed_one_are_refused_with_a_readable_diff(tmp_path):
    logdir = _logdir(tmp_path, experiment.resolve(KEY).params, drop=(ADDED,))
    changed = experiment.resolve(KEY, gin_bindings=["BlobsMlp.hidden_dims = (32,)"],
                                 overrides=f"{ADDED}=0.1").params
    with pytest.raises(ConfigError) as info:
        logdir_lib.check_compatible(logdir, changed)
    message = str(info.value)
    assert message.startswith(f"--logdir={logdir!r} holds another model's run: this run's Params differ from its "
                              "params.txt in task.network.layers (here list of 2, there list of 4); "), message
    assert "task.softmax.input_dim (here 32, there 64); task.softmax.label_smoothing (here 0.1, there absent)" \
        in message and message.endswith("; use a new --logdir or the same model settings"), message


def test_a_field_the_logdir_has_and_this_version_lacks_is_a_difference(tmp_path):
    params = experiment.resolve(KEY).params
    logdir = _logdir(tmp_path, params)
    with open(os.path.join(logdir, "params.txt"), "a") as f:
        f.write("\ntask.softmax.temperature : 1.0\n")
    with pytest.raises(ConfigError, match=r"in task.softmax.temperature \(here absent, there 1.0\); use a new"):
        logdir_lib.check_compatible(logdir, params)


def _append_byte(path):
    with open(path, "ab") as f:
        f.write(b"\xff")


def _empty(path):
    open(path, "w").close()


def _cut_before_model(path):
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text[text.index("task :"):])


def _garbage(path):
    with open(path, "a") as f:
        f.write("\nthis is not params text\n")


@pytest.mark.parametrize("damage, reason", [
    (_append_byte, r"it is not UTF-8 text \(byte 0xff at offset \d+\)"),
    (_empty, "it is empty"),
    (_cut_before_model, r"it has no 'model' line \(cut short\?\)"),
    (_garbage, r"\(line \d+ \('this is not params text'\): expected 'path : value'\)"),
], ids=["not_utf8", "empty", "cut_before_model", "garbage"])
def test_an_unreadable_params_txt_is_one_line_naming_the_file_and_the_fix(tmp_path, damage, reason):
    params = experiment.resolve(KEY).params
    logdir = _logdir(tmp_path, params)
    path = os.path.join(logdir, "params.txt")
    damage(path)
    fix = (f"if it belongs to this run, write it anew with the run's flags (python trainer.py --model={KEY} "
           f"--params=... --mode=inspect_params > {path}), else use a new --logdir")
    for training in (True, False):
        with pytest.raises(ConfigError) as info:
            logdir_lib.check_compatible(logdir, params, training=training)
        assert "\n" not in str(info.value)
        assert re.fullmatch(f"cannot read {re.escape(path)}:? {reason}; {re.escape(fix)}", str(info.value)), \
            str(info.value)
    # resume_warnings, which reads it too, leaves the report to check_compatible.
    assert logdir_lib.resume_warnings(logdir, params, task=None) == []


def test_another_model_with_items_only_there_is_refused(tmp_path):
    # The logdir's network is a pipeline of 3 hidden layers: another class, named once (not its fields).
    logdir = _logdir(tmp_path, experiment.resolve("toy.classifier.BlobsMlpGPipe").params)
    with pytest.raises(ConfigError) as info:
        logdir_lib.check_compatible(logdir, experiment.resolve(KEY).params)
    message = str(info.value)
    assert ("in model (here toy.classifier.BlobsMlp, there toy.classifier.BlobsMlpGPipe); task.network (here "
            "InstantiableParams(gpipe_tf.layers.sequential.Sequential), there "
            "InstantiableParams(gpipe_tf.gpipe.pipeline.GPipe)); use a new --logdir") in message, message
