"""Keep-best checkpoint: the training state with the best value of a chosen eval metric, in logdir/best.

`--mode=train_and_eval` with `train.keep_best_metric` (e.g. 'accuracy' or 'dev/loss') saves the full training
checkpoint to logdir/best/checkpoints/ckpt-<step> whenever an evaluation beats the best value so far (strictly), and
replaces the previous one. Which way is better is `train.keep_best_mode`; its default 'auto' reads it from the
metric's name (`resolve_mode`), so that 'dev/loss' keeps the lowest loss, never the highest, and the run says which
way it chose. logdir/best/best.json records the metric, the mode,
the value and the step, so a resumed run keeps comparing against the best of the runs before it. The directory
is laid out as a run's logdir: `--checkpoint=LOGDIR/best` evaluates, decodes or exports the best checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.training import checkpoints

BEST_DIR = "best"
RECORD_FILE = "best.json"
MODES = ("auto", "max", "min")
# Words of a metric name (split at '/', '_', '-', '.') that mean lower is better: train.keep_best_mode=auto takes
# 'min' for such a metric and 'max' for any other (accuracy, BLEU, chrF, exact match).
LOWER_IS_BETTER = frozenset({"loss", "xent", "nll", "perplexity", "pplx", "ppl", "error", "err", "wer", "cer", "ter",
                             "mse", "mae", "rmse"})


def best_dir(logdir: str) -> str:
    """Where the best checkpoint and its record live."""
    return os.path.join(logdir, BEST_DIR)


def parse_metric(spec: str, datasets: Sequence[str], metric_names: Sequence[str]) -> tuple[str, str]:
    """(dataset, metric) of train.keep_best_metric `spec` ('metric' means the first eval dataset's).

    ConfigError naming the allowed datasets or metrics when `spec` names another.
    """
    if not datasets:
        raise ConfigError(f"train.keep_best_metric={spec!r} needs an evaluation dataset, and eval.datasets is "
                          "empty; set --params=train.keep_best_metric='' or add a dataset to eval.datasets")
    dataset, _, metric = spec.rpartition("/")
    dataset = dataset or datasets[0]
    if dataset not in datasets:
        raise ConfigError(f"train.keep_best_metric={spec!r} names dataset {dataset!r}; the evaluated datasets are "
                          f"{', '.join(datasets)} (eval.datasets)")
    if metric not in metric_names:
        raise ConfigError(f"train.keep_best_metric={spec!r} names metric {metric!r}; the task's metrics are "
                          f"{', '.join(sorted(metric_names))}")
    return dataset, metric


def resolve_mode(metric: str, mode: str) -> str:
    """'max' or 'min' for train.keep_best_metric `metric` and train.keep_best_mode `mode` ('auto': 'min' when a word
    of the metric's name is in LOWER_IS_BETTER, e.g. 'dev/loss', 'log_pplx', 'error_rate'; else 'max')."""
    if mode != "auto":
        return mode
    words = re.split(r"[/_.\-]+", metric.lower())
    return "min" if LOWER_IS_BETTER.intersection(words) else "max"


def describe(name: str, mode: str, chosen: str, directory: str) -> str:
    """The console line saying which evaluation is kept: of `name` (dataset/metric) the lowest or highest (`mode`),
    why (`chosen`, the train.keep_best_mode set) and where (`directory`)."""
    way, other = ("lowest", "max") if mode == "min" else ("highest", "min")
    if chosen == "auto":
        reason = ("the metric's name says lower is better" if mode == "min"
                  else "the metric's name names no loss, error or perplexity")
        why = f"train.keep_best_mode=auto chose {mode}: {reason}; set train.keep_best_mode={other} for the other way"
    else:
        why = f"train.keep_best_mode={chosen}"
    return f"keep-best: the checkpoint of the {way} {name} is kept in {directory} ({why})"


def remove_leftovers(logdir: str) -> list[str]:
    """Deletes what an interrupted save of the best checkpoint left in logdir/best (`checkpoints/ckpt-N_temp/`,
    `checkpoints/checkpoint.tmp*`, the record's temporary); returns their paths relative to logdir/best.

    Only for the trainer that holds the logdir's lock: no other process is saving then.
    """
    removed = [os.path.join(checkpoints.CHECKPOINT_DIR, name)
               for name in checkpoints.remove_leftovers(best_dir(logdir))]
    record_tmp = os.path.join(best_dir(logdir), RECORD_FILE + ".tmp")
    if os.path.isfile(record_tmp):
        os.remove(record_tmp)
        removed.append(RECORD_FILE + ".tmp")
    return removed


class BestCheckpoint:
    """Saves `checkpoint` to logdir/best when an evaluation improves the chosen metric.

    `mode`: train.keep_best_mode ('max', 'min' or 'auto', resolved by `resolve_mode`), named on the console.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, logdir: str, dataset: str, metric: str, mode: str,
                 log: Callable[[str], None]) -> None:
        self.dataset, self.metric, self.mode = dataset, metric, resolve_mode(metric, mode)
        self.name = f"{dataset}/{metric}"
        self.log = log
        self.directory = best_dir(logdir)
        self.record_path = os.path.join(self.directory, RECORD_FILE)
        self.manager = checkpoints.make_manager(checkpoint, self.directory, max_to_keep=1)
        self.best = self._read_record()
        self.log(describe(self.name, self.mode, mode, self.directory))

    def _read_record(self) -> dict | None:
        """The record of earlier runs, if it is about the same metric and mode (else the best restarts)."""
        try:
            with open(self.record_path, encoding="utf-8") as f:
                record = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.log(f"warning: {self.record_path} is unreadable ({e}); the best checkpoint is chosen anew")
            return None
        if record.get("metric") != self.name or record.get("mode") != self.mode:
            self.log(f"keep-best: {self.record_path} is about {record.get('metric')} ({record.get('mode')}), now "
                     f"{self.name} ({self.mode}); the best checkpoint is chosen anew")
            return None
        return record

    def _better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value > self.best["value"] if self.mode == "max" else value < self.best["value"]

    def consider(self, step: int, results: dict[str, dict[str, float]]) -> bool:
        """Saves the current state as the best if `results` (dataset -> metric -> value) improve it."""
        value = results[self.dataset][self.metric]
        if not self._better(value):
            return False
        path = self.manager.save(checkpoint_number=step)
        self.best = {"metric": self.name, "mode": self.mode, "value": value, "step": step, "checkpoint": path}
        tmp = self.record_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.best, f, indent=1)
        os.replace(tmp, self.record_path)
        self.log(f"best {self.name}={value:.4f} at step {step}: saved {path}")
        return True
