"""A trainer forked from the test zygote (tests/helpers/trainer_process.py) is `python trainer.py` to a test: the
same exit code, stdout and stderr, its own pid for signals; commands it could run differently get a real process."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import trainer_process
from tests.helpers.paths import ROOT

COMMANDS = {
    "user-error": ["--model=toy.classifier.BlobMlp", "--logdir=/nonexistent/run"],
    "inspect-params": ["--model=toy.classifier.BlobsMlp", "--mode=inspect_params", "--params=train.learning_rate=0.5"],
    "list-models": ["--list_models"],
}


@pytest.fixture(autouse=True)
def zygote_on(monkeypatch):
    monkeypatch.delenv("GPIPE_TESTS_REAL_PROCESSES", raising=False)


@pytest.mark.parametrize("args", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_forked_trainer_exits_and_prints_as_a_real_one(args):
    command = [sys.executable, "trainer.py", *args]
    forked = trainer_process.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(forked, trainer_process.ForkedTrainer)
    out, err = forked.communicate(timeout=300)
    real = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (forked.returncode, out, err) == (real.returncode, real.stdout, real.stderr)


def test_a_signal_reaches_the_forked_trainer_and_ends_it(tmp_path):
    trainer = trainer_process.Popen(
        [sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlp", f"--logdir={tmp_path}",
         "--max_steps=1000000", "--params=train.log_interval_steps=1,train.save_interval_steps=1000000"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert isinstance(trainer, trainer_process.ForkedTrainer)
    try:
        for line in trainer.stdout:
            if line.startswith("step "):
                break
        assert trainer.poll() is None, "the trainer ended before the signal"
        trainer.send_signal(signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait(timeout=60)
        trainer.stdout.close()
    assert trainer.returncode == -signal.SIGKILL


@pytest.mark.parametrize("change", [{"TF_ENABLE_ONEDNN_OPTS": "0"}, {"PYTHONPATH": "/elsewhere"}],
                         ids=["tensorflow-variable", "pythonpath"])
def test_an_environment_read_at_start_up_gets_a_real_process(change):
    trainer = trainer_process.Popen([sys.executable, "trainer.py", "--list_models"], cwd=ROOT,
                                    env={**os.environ, **change}, stdout=subprocess.DEVNULL)
    assert isinstance(trainer, subprocess.Popen)
    assert trainer.wait(timeout=300) == 0


def test_arguments_the_zygote_does_not_carry_get_a_real_process():
    trainer = trainer_process.Popen([sys.executable, "trainer.py", "--list_models"], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, preexec_fn=lambda: None)
    assert isinstance(trainer, subprocess.Popen)
    assert trainer.wait(timeout=300) == 0
