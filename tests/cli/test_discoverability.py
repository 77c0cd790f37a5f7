"""A new user finds their way: --list_models describes each experiment, the console script's --help lists the
trainer's flags, and a pipeline with more stages than devices says which stages share one."""

import os
import subprocess
import sys

from gpipe_tf import model_registry
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT

# What pip writes as bin/gpipe-trainer for `console_scripts: gpipe-trainer=gpipe_tf.trainer_main:run` (setup.py).
CONSOLE_SCRIPT = """import re
import sys
from gpipe_tf.trainer_main import run
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(run())
"""


def test_list_models_prints_each_key_with_its_docstring_summary():
    result = trainer_process.run([sys.executable, "trainer.py", "--list_models"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    keys = model_registry.list_models()
    assert [line.split()[0] for line in lines] == keys
    for line, key in zip(lines, keys):
        summary = model_registry.summary(model_registry.get(key))
        assert summary != "(no docstring)", f"{key} has no docstring"
        assert line.split(None, 1)[1] == summary
    blobs = next(line for line in lines if line.startswith("toy.classifier.BlobsMlp "))
    assert "classified by a small ReLU MLP" in blobs


def test_summary_is_the_first_paragraph_on_one_line():
    class Documented:
        """First line
        continues here.

        Details that --list_models leaves out.
        """

    class Inherits(Documented):
        pass

    assert model_registry.summary(Documented) == "First line continues here."
    assert model_registry.summary(Inherits) == "First line continues here."
    assert model_registry.summary(type("Bare", (), {})) == "(no docstring)"


def test_console_script_help_lists_the_trainer_flags(tmp_path):
    script = tmp_path / "gpipe-trainer"
    script.write_text(CONSOLE_SCRIPT)
    result = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert f"{script}:" in result.stdout, result.stdout + result.stderr[-2000:]
    for flag in ("--model:", "--logdir:", "--mode:", "--[no]list_models:", "--params:", "--gin_param:",
                 "--logical_devices:"):
        assert flag in result.stdout, (flag, result.stdout)
    # `python trainer.py --help` still lists them too.
    direct = trainer_process.run([sys.executable, "trainer.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=300)
    assert "--model:" in direct.stdout and "--logdir:" in direct.stdout, direct.stdout


def test_fewer_logical_devices_than_stages_warns_naming_the_shared_device(tmp_path):
    result = trainer_process.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlpGPipe",
                                  f"--logdir={tmp_path}", "--logical_devices=1",
                                  "--gin_param=BlobsMlpGPipe.num_stages=3", "--max_steps=1", "--quiet"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    warning = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
    assert warning == ["warning: classifier/network places 3 stages on 1 device: stages 0, 1, 2 share "
                       "/device:CPU:0. Results are the same, but stages sharing a "
                       "device run one after another, not as a pipeline; give each stage its own device (on a CPU: "
                       "--logical_devices=3) or lower num_stages"], result.stdout


def test_one_device_per_stage_gives_no_warning():
    from gpipe_tf import experiment
    from gpipe_tf.training import pipeline_report

    params, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe")
    assert pipeline_report.shared_device_warnings(params.task.instantiate()) == []
    shared, _ = experiment.resolve_params("toy.classifier.BlobsMlpGPipe",
                                          overrides="task.network.devices=['/device:CPU:0', '/device:CPU:0']")
    warnings = pipeline_report.shared_device_warnings(shared.task.instantiate())
    assert len(warnings) == 1 and "stages 0, 1 share /device:CPU:0" in warnings[0], warnings
