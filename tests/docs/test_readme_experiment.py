"""README.md#your-first-experiment is complete and runs as it is written there: its code block, saved as
mypkg/experiments.py of a package outside the checkout, registers the key its commands use, `--list_models
--module=...` lists it, and it trains two steps as a pipeline and evaluates."""

import os
import re
import subprocess
import sys

import pytest

from gpipe_tf import experiment, model_registry
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "mypkg.experiments"
KEY = "mypkg.experiments.MyMlp"


def authoring_blocks():
    """(language, text) of each fenced block of README.md#your-first-experiment, in order."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Your first experiment", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.S | re.M)


def readme_commands():
    return next(body for language, body in authoring_blocks() if language == "")


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A package `mypkg` outside the checkout whose experiments.py is the README's code block, importable."""
    code = next(body for language, body in authoring_blocks() if language == "python")
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "experiments.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(model_registry, "_REGISTRY", dict(model_registry._REGISTRY))
    yield tmp_path
    for name in ("mypkg", MODULE):
        sys.modules.pop(name, None)


def test_readme_commands_use_the_key_of_the_readme_experiment(user_package):
    commands = readme_commands()
    assert set(re.findall(r"--model=(\S+)", commands)) == {KEY}, commands
    assert set(re.findall(r"--module=(\S+)", commands)) == {MODULE}, commands
    cls = model_registry.get(KEY)  # imports mypkg.experiments, as the trainer does for --model
    assert cls.__module__ == MODULE and cls.__name__ == "MyMlp"
    shown = re.search(rf"# ({re.escape(KEY)}\s+.*?)\s*\.\.\.$", commands, flags=re.M)
    assert shown, commands
    assert model_registry.summary(cls).startswith(" ".join(shown.group(1).split()[1:]))


def test_list_models_with_module_lists_the_readme_experiment(user_package, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_package), ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "trainer.py", "--list_models", f"--module={MODULE}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert KEY in listed and "toy.classifier.BlobsMlp" in listed, result.stdout
    assert "A 4-layer ReLU MLP" in listed[KEY]


def test_readme_experiment_trains_and_evaluates(user_package, tmp_path):
    params, _ = experiment.resolve_params(KEY, overrides="train.max_steps=2")
    assert params.logical_devices == 2 and params.task.network.num_stages == 2
    logdir = str(tmp_path / "run")
    logdir_lib.prepare(logdir, params)
    controller = Controller(params, logdir, log=lambda line: None)
    metrics = controller.train(evaluate_every=0)
    assert metrics["loss"] > 0 and int(controller.learner.global_step.numpy()) == 2
    assert controller.task.network.plan.balance == (2, 2)
    assert os.path.exists(os.path.join(logdir, "eval_dev")) and os.path.exists(os.path.join(logdir, "timeline.png"))
