"""The training controller: when to step, checkpoint, summarize, report progress and evaluate.

Thin on purpose (Orbit's controller): the step itself is `Learner.train_step`; this loop decides only the
timing of side effects. A run resumes from the latest checkpoint in the logdir, including the input
iterator's position, so an interrupted run continues exactly where its last checkpoint left it.
"""

from __future__ import annotations

import time
from typing import Callable

import tensorflow as tf

from gpipe_tf.hyperparams import Params
from gpipe_tf.training import checkpoints, pipeline_report
from gpipe_tf.training.evaluator import Evaluator
from gpipe_tf.training.learner import Learner
from gpipe_tf.training.summaries import SummaryWriter


def _format_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Controller:
    """Builds a task, its learner and checkpointing from resolved Params and runs train or eval."""

    def __init__(self, params: Params, logdir: str, log: Callable[[str], None] = print) -> None:
        self.params = params
        self.logdir = logdir
        self.log = log
        self.task = params.task.instantiate()
        self.learner: Learner | None = None

    def _build_training(self) -> None:
        tp = self.params.train
        self.learner = Learner(self.task, tp)
        self.train_input = self.params.input.train.instantiate()
        self.train_iterator = iter(self.train_input.dataset())
        self.checkpoint = tf.train.Checkpoint(task=self.task, optimizer=self.learner.optimizer,
                                              global_step=self.learner.global_step,
                                              train_iterator=self.train_iterator)
        self.manager = checkpoints.make_manager(self.checkpoint, self.logdir, tp.max_checkpoints_to_keep)

    def train(self) -> dict[str, float]:
        """Trains from the latest checkpoint (or scratch) to train.max_steps; returns the last step's metrics."""
        self._build_training()
        tp = self.params.train
        restored = checkpoints.restore_latest(self.checkpoint, self.logdir)
        step = int(self.learner.global_step.numpy())
        if restored:
            self.log(f"resumed from {restored} at step {step}")
        if step >= tp.max_steps:
            self.log(f"step {step} >= max_steps {tp.max_steps}: nothing to train")
            return {}
        writer = SummaryWriter(self.logdir, "train")
        if step == 0:
            writer.text(0, "params", self.params.to_text())
        pipeline_report.write(self.task, self.logdir, writer, step, self.log)
        batch_size = self.params.input.train.batch_size
        metrics: dict[str, tf.Tensor] = {}
        start_step, start_time = step, time.perf_counter()
        summary_step, summary_time = step, start_time
        log_step, log_time = step, start_time
        while step < tp.max_steps:
            metrics = self.learner.train_step(next(self.train_iterator))
            step += 1
            now = time.perf_counter()
            if step % tp.summary_interval_steps == 0 or step == tp.max_steps:
                values = {k: float(v) for k, v in metrics.items()}
                steps_per_sec = (step - summary_step) / max(now - summary_time, 1e-9)
                values.update(steps_per_sec=steps_per_sec, examples_per_sec=steps_per_sec * batch_size)
                writer.scalars(step, values)
                summary_step, summary_time = step, now
            if step % tp.log_interval_steps == 0 or step == tp.max_steps:
                rate = (step - log_step) / max(now - log_time, 1e-9)
                eta = (tp.max_steps - step) / max((step - start_step) / max(now - start_time, 1e-9), 1e-9)
                self.log(f"step {step}/{tp.max_steps} loss={float(metrics['loss']):.4f} "
                         f"lr={float(metrics['learning_rate']):.3g} grad_norm={float(metrics['grad_norm']):.3g} "
                         f"examples/sec={rate * batch_size:.1f} eta={_format_eta(eta)}")
                log_step, log_time = step, now
            if step % tp.save_interval_steps == 0 or step == tp.max_steps:
                self.manager.save(checkpoint_number=step)
        writer.close()
        return {k: float(v) for k, v in metrics.items()}

    def evaluate(self) -> dict[str, dict[str, float]]:
        """Evaluates the latest checkpoint on every dataset in eval.datasets; writes logdir/eval_<name>."""
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        checkpoint = tf.train.Checkpoint(task=self.task, global_step=global_step)
        # Read-only: the evaluator never saves into the trainer's checkpoint directory.
        path = checkpoints.restore_latest(checkpoint, self.logdir, partial=True)
        if path is None:
            self.log(f"no checkpoint in {checkpoints.checkpoint_dir(self.logdir)}: evaluating initial weights")
        step = int(global_step.numpy())
        results = {}
        for name in self.params.eval.datasets:
            values = Evaluator(self.task, name, self.params.input.get(name)).run()
            writer = SummaryWriter(self.logdir, f"eval_{name}")
            writer.scalars(step, values)
            writer.close()
            self.log(f"eval {name} at step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in sorted(values.items())))
            results[name] = values
        return results
