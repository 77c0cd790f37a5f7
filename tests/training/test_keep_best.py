"""Keep-best checkpoint: train_and_eval keeps the state with the best eval metric in logdir/best, across resumes."""

import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training import keep_best
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.controller import Controller
from gpipe_tf.training.summaries import read_scalars
from tests.helpers import trainer_process
from tests.helpers.paths import ROOT

KEY = "toy.classifier.BlobsMlp"


def params(max_steps, metric, mode=None):
    """train_and_eval Params evaluating every 5 steps; `mode` None leaves train.keep_best_mode at its default."""
    p, _ = experiment.resolve_params(KEY, overrides=(
        f"train.max_steps={max_steps},train.eval_interval_steps=5,train.save_interval_steps=5,"
        f"train.max_checkpoints_to_keep=20,train.keep_best_metric={metric}"
        + ("" if mode is None else f",train.keep_best_mode={mode}")))
    return p


def train_and_eval(logdir, p):
    logdir_lib.prepare(logdir, p)
    lines = []
    Controller(p, logdir, log=lines.append).train(evaluate_every=p.train.eval_interval_steps)
    return lines


def best_of(logdir, dataset, metric, mode):
    """(step, value) of the best evaluation in the eval summaries, the first one on ties."""
    steps, values = zip(*read_scalars(f"{logdir}/eval_{dataset}")[metric])
    i = int(np.argmax(values) if mode == "max" else np.argmin(values))
    return steps[i], values[i]


def task_tensors(path):
    reader = tf.train.load_checkpoint(path)
    return {n: reader.get_tensor(n) for n, d in reader.get_variable_to_dtype_map().items()
            if n.startswith("task/") and d.is_floating}


@pytest.mark.parametrize("metric,dataset,name,mode", [("loss", "dev", "loss", "min"),
                                                      ("test/accuracy", "test", "accuracy", "min")])
def test_best_checkpoint_is_the_best_evaluation_and_survives_a_resume(tmp_path, metric, dataset, name, mode):
    logdir = str(tmp_path)
    printed = []  # the console lines of both runs
    for max_steps in (20, 35):
        lines = train_and_eval(logdir, params(max_steps, metric, mode))
        printed += lines
        step, value = best_of(logdir, dataset, name, mode)
        with open(os.path.join(logdir, "best", "best.json"), encoding="utf-8") as f:
            record = json.load(f)
        assert (record["metric"], record["mode"], record["step"]) == (f"{dataset}/{name}", mode, step)
        assert record["value"] == pytest.approx(value, rel=1e-6)
        kept = sorted(n for n in os.listdir(os.path.join(logdir, "best", "checkpoints")) if n.endswith(".index"))
        assert kept == [f"ckpt-{step}.index"]
        best, same_step = (task_tensors(os.path.join(logdir, d, "checkpoints", f"ckpt-{step}")) for d in ("best", ""))
        assert best.keys() == same_step.keys() and len(best) == 6
        for n in best:
            np.testing.assert_array_equal(best[n], same_step[n])
        # The run that found the best evaluation said so, whichever of the two it was.
        assert any(line.startswith(f"best {dataset}/{name}=") and f"at step {step}:" in line for line in printed)
    # --checkpoint=LOGDIR/best evaluates it.
    by_step = Controller(params(35, metric, mode), logdir, log=lambda line: None).evaluate(
        chosen=os.path.join(logdir, "best"))
    assert list(by_step) == [step]
    assert by_step[step][dataset][name] == pytest.approx(record["value"], rel=1e-6)


@pytest.mark.parametrize("metric,mode", [("loss", "min"), ("log_pplx", "min"), ("error_rate", "min"), ("WER", "min"),
                                         ("accuracy", "max"), ("token_accuracy", "max"), ("bleu", "max"),
                                         ("chrf", "max"), ("exact_match", "max"), ("interpreter", "max")])
def test_the_default_mode_follows_the_metrics_name(metric, mode):
    assert keep_best.resolve_mode(metric, "auto") == mode
    assert keep_best.resolve_mode(metric, "max") == "max" and keep_best.resolve_mode(metric, "min") == "min"


@pytest.mark.exhaustive(covered_by=(
    "tests/cli/test_resume_console.py::test_keep_best_on_a_loss_keeps_the_lowest_and_says_so",
    "tests/training/test_keep_best.py::test_the_default_mode_follows_the_metrics_name",
))
def test_a_loss_metric_with_the_default_mode_keeps_the_lowest_and_says_so(tmp_path):
    logdir = str(tmp_path)
    lines = train_and_eval(logdir, params(20, "dev/loss"))
    lowest, _ = best_of(logdir, "dev", "loss", "min")
    highest, _ = best_of(logdir, "dev", "loss", "max")
    assert lowest != highest  # the two ways keep different checkpoints here
    with open(os.path.join(logdir, "best", "best.json"), encoding="utf-8") as f:
        record = json.load(f)
    assert (record["mode"], record["step"]) == ("min", lowest)
    said = [line for line in lines if line.startswith("keep-best: ")]
    assert said == [f"keep-best: the checkpoint of the lowest dev/loss is kept in {logdir}/best "
                    "(train.keep_best_mode=auto chose min: the metric's name says lower is better; set "
                    "train.keep_best_mode=max for the other way)"]


def test_a_record_of_another_metric_is_not_compared(tmp_path):
    logdir = str(tmp_path)
    train_and_eval(logdir, params(10, "loss", "min"))
    lines = train_and_eval(logdir, params(15, "loss", "max"))
    assert any("is about dev/loss (min), now dev/loss (max)" in line for line in lines)
    with open(os.path.join(logdir, "best", "best.json"), encoding="utf-8") as f:
        assert json.load(f)["step"] == 15  # the only evaluation of the second run


def test_an_unknown_metric_or_dataset_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="names metric 'acuracy'; the task's metrics are accuracy, loss"):
        Controller(params(10, "acuracy", "max"), str(tmp_path)).prepare_training()
    with pytest.raises(ConfigError, match="names dataset 'train'; the evaluated datasets are dev, test"):
        Controller(params(10, "train/loss", "max"), str(tmp_path)).prepare_training()
    with pytest.raises(ParamsError, match="train.keep_best_mode='best' must be one of auto, max, min"):
        Controller(params(10, "loss", "best"), str(tmp_path)).prepare_training()


def test_the_trainer_refuses_an_unknown_metric_in_one_line_and_writes_nothing(tmp_path):
    logdir = tmp_path / "run"
    result = trainer_process.run([sys.executable, "trainer.py", f"--model={KEY}", f"--logdir={logdir}",
                                  "--mode=train_and_eval", "--params=train.keep_best_metric=dev/acuracy"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainer.py: error: ")]
    assert len(errors) == 1 and "names metric 'acuracy'" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not logdir.exists()
