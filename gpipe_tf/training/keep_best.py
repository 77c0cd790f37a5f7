"""Keep-best checkpoint: the training state with the best value of a chosen eval metric, in logdir/best.

`--mode=train_and_eval` with `train.keep_best_metric` (e.g. 'accuracy', or 'dev/loss' with train.keep_best_mode
'min') saves the full training checkpoint to logdir/best/checkpoints/ckpt-<step> whenever an evaluation beats the
best value so far (strictly), and replaces the previous one. logdir/best/best.json records the metric, the mode,
the value and the step, so a resumed run keeps comparing against the best of the runs before it. The directory
is laid out as a run's logdir: `--checkpoint=LOGDIR/best` evaluates, decodes or exports the best checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.training import checkpoints

BEST_DIR = "best"
RECORD_FILE = "best.json"


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
    """Saves `checkpoint` to logdir/best when an evaluation improves the chosen metric."""

    def __init__(self, checkpoint: tf.train.Checkpoint, logdir: str, dataset: str, metric: str, mode: str,
                 log: Callable[[str], None]) -> None:
        self.dataset, self.metric, self.mode = dataset, metric, mode
        self.name = f"{dataset}/{metric}"
        self.log = log
        self.directory = best_dir(logdir)
        self.record_path = os.path.join(self.directory, RECORD_FILE)
        self.manager = checkpoints.make_manager(checkpoint, self.directory, max_to_keep=1)
        self.best = self._read_record()

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
