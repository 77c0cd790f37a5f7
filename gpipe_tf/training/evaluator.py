"""Evaluation: weighted-average metrics over a finite dataset, written to logdir/eval_<dataset>."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import Params
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.tasks.base_task import BaseTask


class Evaluator:
    """Computes a task's metrics on one dataset; `tf.function` per batch, sums on the host."""

    def __init__(self, task: BaseTask, dataset_name: str, input_params: Params) -> None:
        if input_params is None:
            raise ConfigError(f"the experiment has no {dataset_name!r} dataset; choose from the experiment's "
                              "eval.datasets")
        if input_params.num_batches is None:
            raise ConfigError(f"input.{dataset_name}.num_batches is None, so evaluation would never end; set "
                              f"--params=input.{dataset_name}.num_batches=100")
        self.task = task
        self.name = dataset_name
        self.input = input_params.instantiate()
        self._step = tf.function(self._eval_step, autograph=False)

    def _eval_step(self, batch: Mapping[str, tf.Tensor]) -> dict[str, tuple[tf.Tensor, tf.Tensor]]:
        _, metrics = self.task.compute_loss(self.task.fprop_theta, batch, FPropContext(training=False))
        return {k: (tf.cast(v, tf.float64) * tf.cast(w, tf.float64), tf.cast(w, tf.float64))
                for k, (v, w) in metrics.items()}

    @property
    def num_batches(self) -> int:
        """Batches in one pass over the dataset."""
        return self.input.p.num_batches

    def run(self, on_batch: Callable[[int], None] | None = None) -> dict[str, float]:
        """Weighted means of every metric over the whole dataset; `on_batch(n)` after the n-th batch (progress)."""
        sums: dict[str, list[float]] = {}
        for n, batch in enumerate(self.input.dataset(), start=1):
            for k, (vw, w) in self._step(batch).items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += float(vw)
                acc[1] += float(w)
            if on_batch is not None:
                on_batch(n)
        return {k: vw / w for k, (vw, w) in sums.items() if w > 0}
