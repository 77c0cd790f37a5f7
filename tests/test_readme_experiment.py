"""The README's authoring example is complete and runs: its code block, loaded as params/toy/my_mlp.py, registers
the key its commands use, trains two steps as a pipeline and evaluates."""

import os
import re
import sys
import types

import pytest

from gpipe_tf import model_registry
from gpipe_tf import experiment
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "params.toy.my_mlp"


def authoring_blocks():
    """(language, text) of each fenced block of the README's authoring section, in order."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Writing and registering an experiment", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.S | re.M)


@pytest.fixture
def readme_module(monkeypatch):
    """The README's code block executed as the module params/toy/my_mlp.py would be (same name, same key)."""
    monkeypatch.setattr(model_registry, "_REGISTRY", dict(model_registry._REGISTRY))
    code = next(body for language, body in authoring_blocks() if language == "python")
    module = types.ModuleType(MODULE)
    module.__file__ = os.path.join(ROOT, "params", "toy", "my_mlp.py")
    monkeypatch.setitem(sys.modules, MODULE, module)
    exec(compile(code, module.__file__, "exec"), module.__dict__)  # noqa: S102 - the README's own example
    return module


def test_readme_experiment_registers_the_key_its_commands_use(readme_module):
    commands = next(body for language, body in authoring_blocks() if language == "")
    keys = set(re.findall(r"--model=(\S+)", commands))
    assert keys == {"toy.my_mlp.MyMlp"}, commands
    assert model_registry.get("toy.my_mlp.MyMlp") is readme_module.MyMlp
    assert "toy.my_mlp.MyMlp  A 4-layer ReLU MLP" in commands  # the --list_models line shown is the docstring's


def test_readme_experiment_trains_and_evaluates(readme_module, tmp_path):
    params, _ = experiment.resolve_params("toy.my_mlp.MyMlp", overrides="train.max_steps=2")
    assert params.logical_devices == 2 and params.task.network.num_stages == 2
    logdir = str(tmp_path)
    logdir_lib.prepare(logdir, params)
    controller = Controller(params, logdir, log=lambda line: None)
    metrics = controller.train(evaluate_every=0)
    assert metrics["loss"] > 0 and int(controller.learner.global_step.numpy()) == 2
    assert [p.balance for p in [controller.task.network.plan]] == [(2, 2)]
    assert os.path.exists(os.path.join(logdir, "eval_dev")) and os.path.exists(os.path.join(logdir, "schedule.png"))
