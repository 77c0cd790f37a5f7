"""An experiment in the user's own package, installed with `pip install -e` outside the checkout, is listed and
trained by the installed `gpipe-trainer` without editing the checkout."""

import os
import sys
import textwrap

import pytest
from absl import logging
from absl.testing import flagsaver

from gpipe_tf import trainer_main
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT
from tests.helpers.trainer_errors import one_error_line

EXPERIMENT = textwrap.dedent('''\
    """Experiments of a user's own package."""

    from gpipe_tf import model_registry
    from gpipe_tf.params.toy.classifier import BlobsMlp


    @model_registry.register
    class NarrowMlp(BlobsMlp):
        """A narrower MLP on the blobs, defined outside gpipe_tf."""

        hidden_dims = (16, 16)
    ''')


BRANCHING = textwrap.dedent('''\
    """An experiment whose layer branches on a tensor with a Python if."""

    import tensorflow as tf

    from gpipe_tf import model_registry
    from gpipe_tf.layers.activations import Activation
    from gpipe_tf.params.toy.classifier import BlobsMlp


    class BranchingRelu(Activation):
        """ReLU where some input is positive, identity elsewhere, written as a Python if on a tensor."""

        def fprop(self, theta, inputs, ctx):
            if tf.reduce_max(inputs) > 0:
                return tf.nn.relu(inputs)
            return inputs


    @model_registry.register
    class BranchingMlp(BlobsMlp):
        """BlobsMlp with the branching layer after its first hidden layer."""

        def task(self):
            p = super().task()
            p.network.layers.insert(1, BranchingRelu.params().set(name="branching"))
            return p
    ''')
BRANCHING_LINE = 14  # the `if` of BranchingRelu.fprop

RAISING = "RATE = 1\n\n\ndef scale():\n    return RATE / 0\n\n\nFACTOR = scale()\n"  # raises on line 5


def run(*args, cwd, timeout=300):
    return trainer_process.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


@pytest.fixture
def user_package(tmp_path):
    """`userexp` with `userexp.experiments.mine.NarrowMlp`, installed editable into this interpreter's environment
    for the test (offline: no build isolation, no dependencies), uninstalled afterwards."""
    root = tmp_path / "userexp_src"
    package = root / "userexp" / "experiments"
    package.mkdir(parents=True)
    (root / "userexp" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text(EXPERIMENT)
    (root / "pyproject.toml").write_text(textwrap.dedent('''\
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "userexp"
        version = "0.0.1"
        '''))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index", "-e",
           str(root)]
    installed = run(*pip, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    try:
        yield tmp_path
    finally:
        run(sys.executable, "-m", "pip", "uninstall", "-q", "-y", "userexp", cwd=tmp_path)


@pytest.mark.exhaustive(covered_by=(
    "tests/docs/test_readme_experiment.py::test_list_models_with_module_lists_the_readme_experiment",
    "tests/docs/test_readme_experiment.py::test_readme_experiment_trains_and_evaluates",
    "tests/cli/test_discoverability.py::test_console_script_help_lists_the_trainer_flags",
))
def test_gpipe_trainer_lists_and_trains_an_experiment_of_a_user_package(user_package):
    script = os.path.join(os.path.dirname(sys.executable), "gpipe-trainer")
    key = "userexp.experiments.mine.NarrowMlp"
    listed = run(script, "--module=userexp.experiments", "--list_models", cwd=user_package)
    assert listed.returncode == 0, listed.stderr[-3000:]
    lines = listed.stdout.splitlines()
    assert any(line.startswith(key) and "defined outside gpipe_tf" in line for line in lines), listed.stdout
    assert any(line.startswith("toy.classifier.BlobsMlp ") for line in lines), listed.stdout
    logdir = user_package / "run"
    trained = run(script, f"--model={key}", f"--logdir={logdir}", "--max_steps=3", "--quiet", cwd=user_package)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (logdir / "checkpoints").is_dir()
    params_txt = (logdir / "params.txt").read_text()
    assert f"model : '{key}'" in params_txt and "output_dim : 16" in params_txt, params_txt[:2000]


def test_a_key_whose_module_is_not_installed_is_one_line(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "gpipe-trainer")
    result = run(script, "--module=nowhere_pkg.experiments", "--list_models", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "trainer.py: error: cannot import experiment module 'nowhere_pkg.experiments': no module named "
        "'nowhere_pkg'; install the package that holds it (pip install -e PATH) or fix the name"], result.stderr


@pytest.fixture
def raising_package(tmp_path):
    """`raising_user_pkg`, whose module `mine` raises ZeroDivisionError on line 5 while it is imported; forgotten by
    this process afterwards."""
    (tmp_path / "raising_user_pkg").mkdir()
    (tmp_path / "raising_user_pkg" / "__init__.py").write_text("")
    (tmp_path / "raising_user_pkg" / "mine.py").write_text(RAISING)
    yield tmp_path
    for name in [m for m in sys.modules if m.partition(".")[0] == "raising_user_pkg"]:
        del sys.modules[name]


def expected_import_error(package):
    return (f"trainer.py: error: experiment module 'raising_user_pkg.mine' failed to import: ZeroDivisionError: "
            f"division by zero (at {package / 'raising_user_pkg' / 'mine.py'}:5); fix the module there, or run the "
            "trainer with --traceback to see Python's traceback")


def test_a_module_that_raises_at_import_is_one_line(raising_package):
    # issue 35 item 6: a 29-line traceback before; now the module, the exception and its line, exit status 2.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(raising_package), ROOT])}
    result = trainer_process.run([sys.executable, "trainer.py", "--module=raising_user_pkg", "--list_models"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=300, env=env)
    assert one_error_line(result) == expected_import_error(raising_package)


def test_traceback_flag_prints_the_module_traceback_before_the_line(raising_package, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(raising_package))
    verbosity = logging.get_verbosity()
    try:
        with flagsaver.as_parsed(module=["raising_user_pkg"], list_models="true", traceback="true"):
            with pytest.raises(SystemExit) as exited:
                trainer_main.main(["trainer.py"])
    finally:
        logging.set_verbosity(verbosity)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == expected_import_error(raising_package), lines
    # Python's traceback of the error the module raised, down to its line, then the chain to the one line.
    assert lines[0] == "Traceback (most recent call last):", lines
    assert f'  File "{raising_package / "raising_user_pkg" / "mine.py"}", line 5, in scale' in lines, lines
    assert "ZeroDivisionError: division by zero" in lines, lines


def test_a_layer_that_branches_on_a_tensor_in_python_is_one_line_with_the_ways_out(tmp_path):
    # The trainer traces without AutoGraph (docs/experiments.md#control-flow-in-a-layer); TensorFlow's own error
    # suggests decorating with @tf.function, which does not help there.
    (tmp_path / "branching_user_pkg").mkdir()
    (tmp_path / "branching_user_pkg" / "__init__.py").write_text("")
    (tmp_path / "branching_user_pkg" / "mine.py").write_text(BRANCHING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    result = trainer_process.run([sys.executable, "trainer.py", "--module=branching_user_pkg.mine",
                                  "--model=branching_user_pkg.mine.BranchingMlp", f"--logdir={tmp_path / 'run'}",
                                  "--max_steps=1"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert one_error_line(result) == (
        f"trainer.py: error: {tmp_path / 'branching_user_pkg' / 'mine.py'}:{BRANCHING_LINE} uses a tensor as a "
        "Python bool or iterates over it while the step is traced; the trainer traces without AutoGraph "
        "(docs/experiments.md#control-flow-in-a-layer): write it with tf.cond, tf.where or tf.while_loop, or "
        "convert that function with tf.autograph.to_graph")
