"""The training controller: when to step, checkpoint, summarize, report progress and evaluate.

Thin on purpose (Orbit's controller): the step itself is `Learner.train_step`; this loop decides only the
timing of side effects and what happens on failure. A run resumes from the newest readable checkpoint in the
logdir, including the input iterator's position, so an interrupted run continues exactly where it was saved.

Failures lose nothing: SIGTERM/SIGINT save a checkpoint and end the run normally; a NaN/Inf loss or gradient
stops it before the bad update reaches the variables, without saving, so the latest checkpoint is the last good
one (or the step is skipped, `train.skip_nonfinite_steps`); a checkpoint that cannot be written (a full disk)
stops it and leaves the previous checkpoint the latest.

Data parallelism (training/replicas.py): the task is built with one pipeline replica per local replica; in a
multi-worker run only the chief writes checkpoints, summaries and reports, and every worker starts from the chief's
variables and step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from gpipe_tf.errors import ConfigError, TrainingError
from gpipe_tf.gpipe import placement
from gpipe_tf.hyperparams import Params
from gpipe_tf.training import checkpoints, hparams, init_from, keep_best, pipeline_report, progress, weight_ema
from gpipe_tf.training import logdir as logdir_lib
from gpipe_tf.training.evaluator import Evaluator
from gpipe_tf.training.learner import Learner, describe_precision
from gpipe_tf.training.replicas import ReplicaLayout, replica_home_devices
from gpipe_tf.training.summaries import SummaryWriter
from gpipe_tf.training.zero_gradients import ZeroGradientWatch, stages_of

DONE_FILE = "TRAINING_DONE"
# Step outputs that are masks over the trained variables, not numbers.
_MASK_KEYS = ("nonfinite_gradients", "zero_gradients")
# Step outputs that are flags, not scalars to summarize.
_STATUS_KEYS = ("nonfinite", "stop", *_MASK_KEYS)
# At most this many variable names in a message.
_NAMES_SHOWN = 4


class _NoSummaries:
    """The summary writer of a non-chief worker: the chief writes the run's summaries."""

    def scalars(self, step: int, values: Any) -> None:
        """Writes nothing."""

    def text(self, step: int, name: str, text: str) -> None:
        """Writes nothing."""

    def close(self) -> None:
        """Nothing to close."""


def _names(names: list[str]) -> str:
    """Up to _NAMES_SHOWN names, in the given (variable) order, and how many more."""
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def _format_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _memory_scalars() -> dict[str, float]:
    """Peak memory of each local device TensorFlow reports it for (remote devices do not)."""
    out = {}
    for device in tf.config.list_logical_devices():
        # Local devices are named "/device:CPU:0" (or "/job:localhost/..."); remote ones cannot report.
        if not device.name.startswith("/job:") or device.name.startswith("/job:localhost"):
            try:
                out[f"memory/peak_mb/{device.device_type}:{device.name.rsplit(':', 1)[1]}"] = (
                    tf.config.experimental.get_memory_info(device.name)["peak"] / 2 ** 20)
            except (ValueError, tf.errors.OpError):
                continue
    return out


class Controller:
    """Builds a task, its learner and checkpointing from resolved Params and runs train or eval."""

    def __init__(self, params: Params, logdir: str, log: Callable[[str], None] = print,
                 quiet: bool = False, profile_steps: tuple[int, int] | None = None,
                 layout: ReplicaLayout | None = None, knobs: dict[str, Any] | None = None,
                 clock: progress.Clock = time.perf_counter) -> None:
        self.params = params
        # The experiment's knob values (experiment.resolve), shown with the run in TensorBoard's HParams tab.
        self.knobs = dict(knobs or {})
        self.logdir = logdir
        self.log = log
        self.progress = (lambda s: None) if quiet else log
        self.profile_steps = profile_steps
        # The clock of step times, ETA and phase durations (tests pass a fake one: no timing-dependent asserts).
        self.clock = clock
        self._trace_secs = 0.0
        # `layout`: this process's data-parallel replicas (replicas.make_layout); None: one replica.
        self.layout = layout or ReplicaLayout()
        with placement.replicas(self.layout.local_replicas):
            self.task = params.task.instantiate()
        self.layout.attach_devices(replica_home_devices(self.task, self.layout.local_replicas))
        self.learner: Learner | None = None
        self._restored: str | None = None
        self._init_from_prepared: tuple[str, init_from.InitPlan] | None = None  # a new run's checked source
        self._ready = False
        self.manager: tf.train.CheckpointManager | None = None  # made by restore(), after any state-file repair
        self._stop_signal: int | None = None
        self._evaluators: dict[str, Evaluator] = {}
        self._best_metric: tuple[str, str] = ("", "")  # train.keep_best_metric as (dataset, metric)
        self._best: keep_best.BestCheckpoint | None = None  # train_and_eval with train.keep_best_metric
        self._ema_reader: weight_ema.WeightEma | None = None  # eval: the checkpoints' weight averages
        # The checkpoints this process saved or restored since the last applied (finite) step: all hold the weights
        # the next step starts from, as a skipped step changes none (see _quarantine_if_bad).
        self._holding_current_weights: list[str] = []
        # Steps skipped as non-finite (train.skip_nonfinite_steps) in this process: in all and in a row now.
        self._skipped = 0
        self._skipped_in_a_row = 0

    # ----------------------------------------------------------------------------------------------- training

    def prepare_training(self) -> None:
        """Builds the learner and input and traces the train step: every config error surfaces here.

        Writes nothing, so that the trainer can check a command completely before it touches the logdir. The step
        is traced on a batch of a second iterator over the same dataset, so the training stream is not advanced.
        """
        if self._ready:
            return
        self._build_training()
        source = self.params.train.init_from.checkpoint
        if source and not checkpoints.checkpoint_paths(self.logdir):
            # A new run will read it: a wrong path, an unreadable source or rules that copy nothing are refused
            # before anything is written.
            self._init_from_prepared = init_from.prepare(self.task.variables, self.params.train.init_from)
        self.progress(describe_precision(self.learner.precision))
        # Tracing here and graph optimization in the first step take from seconds to minutes on a pipeline.
        self.progress("compiling the train step ...")
        start = self.clock()
        probe = next(iter(self.train_input.dataset()))
        self.learner.train_step.get_concrete_function(probe, tf.constant(False))
        self._trace_secs = self.clock() - start
        if self.params.train.keep_best_metric:  # the metric names are known now
            self._best_metric = keep_best.parse_metric(self.params.train.keep_best_metric,
                                                       list(self.params.eval.datasets), self.learner.task_metric_names)
        self._ready = True

    def restore(self) -> str | None:
        """Restores the newest checkpoint that restores completely (warnings name damaged files); returns its path.

        Raises ConfigError, having written nothing, when checkpoints exist but none restores. Once a checkpoint is
        restored, the chief rewrites a damaged or stale state file so that the checkpoint manager counts (and never
        forgets) the checkpoints on disk.
        """
        self.prepare_training()
        if self.layout.is_chief:
            removed = checkpoints.remove_leftovers(self.logdir)
            if removed:
                self.log(f"removed {', '.join(removed)} from {checkpoints.checkpoint_dir(self.logdir)}: leftovers of "
                         "a save that was interrupted (no complete checkpoint is among them)")
            # Whatever this run's mode: a killed train_and_eval run leaves them while it saves the best checkpoint.
            removed = keep_best.remove_leftovers(self.logdir)
            if removed:
                self.log(f"removed {', '.join(removed)} from {keep_best.best_dir(self.logdir)}: leftovers of a save "
                         "of the best checkpoint that was interrupted (the best checkpoint itself is kept)")
        problem = checkpoints.state_file_problem(self.logdir)
        on_disk = checkpoints.checkpoint_paths(self.logdir)
        # The weight averages, when kept, are restored by weight_ema.resume below.
        averages = (weight_ema.CHECKPOINT_KEY,) if self._restorable is not self.checkpoint else ()
        self._restored = checkpoints.restore_latest(self._restorable, self.logdir, warn=self.log,
                                                    read_elsewhere=averages)
        if self._restored and self._restorable is not self.checkpoint:
            # The checkpoint that saves is another object than the one restored (see _build_training): it carries
            # the save count on, so that a resumed run writes what an uninterrupted one would.
            self.checkpoint.save_counter.assign(self._restorable.save_counter)
        self._holding_current_weights = [self._restored] if self._restored else []
        if self._restored and self.learner.ema is not None:
            weight_ema.resume(self.learner.ema, self._restored, self.log)
        if self._restored is None and self.params.train.init_from.checkpoint:
            # A new run (step 0): fine-tuning starts from another run's variables; a resumed run never re-reads them.
            init_from.apply(self.task.variables, self.params.train.init_from, self.log, self._init_from_prepared)
        elif self._restored and self.params.train.init_from.checkpoint:
            self.log(f"train.init_from.checkpoint={self.params.train.init_from.checkpoint!r} not applied: the run "
                     f"resumes from its own {self._restored} (init_from starts only a new run; use a new --logdir "
                     "to start from it)")
        if self._restored and self.layout.is_chief and (problem or self._restored != on_disk[-1]):
            checkpoints.repair_state_file(self.logdir, self._restored)
        self.manager = checkpoints.make_manager(self.checkpoint, self.logdir,
                                                self.params.train.max_checkpoints_to_keep)
        return self._restored

    def _build_training(self) -> None:
        tp = self.params.train
        batch_size = self.params.input.train.batch_size
        if batch_size % self.layout.num_replicas:
            raise ConfigError(f"input.train.batch_size={batch_size} is not divisible by the "
                              f"{self.layout.num_replicas} data-parallel replicas; use a multiple of "
                              f"{self.layout.num_replicas} (each replica gets an equal slice)")
        self.learner = Learner(self.task, tp, self.layout)
        self._zero_watch = ZeroGradientWatch(stages_of(self.task, self.learner.variables_to_train),
                                             self.learner.gradient_names(), self.learner.loss_scale_method,
                                             tp.loss_scale)
        self.train_input = self.params.input.train.instantiate()
        self.train_iterator = iter(self.train_input.dataset())
        state = dict(task=self.task, optimizer=self.learner.optimizer, global_step=self.learner.global_step,
                     train_iterator=self.train_iterator, **self.learner.checkpointed())
        self.checkpoint = tf.train.Checkpoint(**state)
        # With weight averages on, restored without them: a resumed run may have turned them on (weight_ema.resume).
        self._restorable = self.checkpoint if weight_ema.CHECKPOINT_KEY not in state else tf.train.Checkpoint(
            **{k: v for k, v in state.items() if k != weight_ema.CHECKPOINT_KEY})

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum

    def _save(self, step: int) -> None:
        if not self.layout.is_chief:
            return
        bad = [name for name, b in zip(self.learner.gradient_names(), self.learner.nonfinite_variables().numpy()) if b]
        if bad:
            # Finite gradients can still make a non-finite update (a learning rate of 1e30): such variables are
            # never saved, so every checkpoint on disk is a good state to resume from.
            raise TrainingError(f"the variables {_names(bad)} are non-finite after the update of step {step} (its "
                                f"gradients were finite); not saved, so {self._last_checkpoint()} is the last good "
                                "state; lower the learning rate or clip gradients (train.clip_gradient_norm)")
        try:
            path = self.manager.save(checkpoint_number=step)
        except (OSError, tf.errors.OpError) as e:
            directory = checkpoints.checkpoint_dir(self.logdir)
            raise TrainingError(f"could not write the checkpoint of step {step} to {directory} "
                                f"({checkpoints.write_failure(e, directory)}); the previous checkpoint "
                                f"{self._last_checkpoint()} is intact; free disk space and run again to resume "
                                "from it") from None
        self._holding_current_weights.append(path)
        self.progress(f"saved checkpoint {path}")

    def train(self, evaluate_every: int | None = None) -> dict[str, float]:
        """Trains from the newest checkpoint (or scratch) to train.max_steps; returns the last step's metrics.

        `evaluate_every` (train_and_eval): evaluate every that many steps and at the end; 0 only at the end.
        """
        if self.manager is None:  # the trainer normally restored already, under the logdir's lock
            self.restore()
        restored = self._restored
        tp = self.params.train
        done_path = os.path.join(self.logdir, DONE_FILE)
        if self.layout.is_chief and os.path.exists(done_path):
            os.remove(done_path)
        # Every worker continues from the chief's state, whether or not it could read the checkpoint itself.
        self.layout.broadcast_from_chief([*self.task.variables, *self.learner.optimizer.variables,
                                          self.learner.global_step,
                                          *[v for m in self.learner.checkpointed().values() for v in m.variables]])
        step = int(self.learner.global_step.numpy())
        self.layout.check_agreement({"train.max_steps": tp.max_steps,
                                     "input.train.batch_size": self.params.input.train.batch_size})
        if self.layout.num_replicas > 1:
            self.log(self.layout.describe())
        if restored:
            self.log(f"resumed from {restored} at step {step}")
        if tp.keep_best_metric and self.layout.is_chief:
            if evaluate_every is None:
                self.log(f"note: train.keep_best_metric={tp.keep_best_metric!r} is kept by --mode=train_and_eval; "
                         "this mode does not evaluate, so logdir/best is not updated")
            else:
                self._best = keep_best.BestCheckpoint(self.checkpoint, self.logdir, *self._best_metric,
                                                      tp.keep_best_mode, self.log)
        if step >= tp.max_steps:
            self.log(f"step {step} >= max_steps {tp.max_steps}: nothing to train")
            self._mark_done(step)
            return {}
        writer: SummaryWriter | _NoSummaries = (SummaryWriter(self.logdir, "train") if self.layout.is_chief
                                                else _NoSummaries())
        if step == 0:
            writer.text(0, "params", self.params.to_text())
        for warning in pipeline_report.shared_device_warnings(self.task):
            self.log(warning)
        if self.layout.is_chief:
            pipeline_report.write(self.task, self.logdir, writer, step, self.progress, self.params.train)
            hparams.write_session(self.logdir, hparams.hparams_of(self.params, self.knobs, self.learner.precision),
                                  hparams.metric_tags(self.params, self.learner.task_metric_names))
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            metrics = self._loop(step, writer, evaluate_every)
            if self.layout.is_chief and "loss" in metrics:
                hparams.write_metrics(self.logdir, int(self.learner.global_step.numpy()),
                                      {"train/loss": metrics["loss"]})
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            writer.close()
        return metrics

    def _loop(self, step: int, writer: SummaryWriter | _NoSummaries, evaluate_every: int | None) -> dict[str, float]:
        tp = self.params.train
        batch_size = self.params.input.train.batch_size
        metrics: dict[str, Any] = {}
        start_step, start_time = step, self.clock()
        summary_step, summary_time = step, start_time
        log_step, log_time = step, start_time
        # Console rate and ETA come from steady-state steps: the first step of a run includes graph compilation.
        steady_step, steady_time = None, None
        while step < tp.max_steps:
            if self.profile_steps and step == self.profile_steps[0]:
                tf.profiler.experimental.start(self.logdir)
            metrics = self.learner.train_step(next(self.train_iterator),
                                              tf.constant(self._stop_signal is not None))
            step += 1
            if self.profile_steps and step == self.profile_steps[1]:
                tf.profiler.experimental.stop()
                self.log(f"profile of steps {self.profile_steps[0]}-{step} written to {self.logdir}/plugins/profile")
            if bool(metrics["nonfinite"]):
                self._nonfinite(step, metrics, step - start_step)
            else:
                self._skipped_in_a_row = 0
                self._holding_current_weights = []
            for warning in self._zero_watch.observe(step, metrics["zero_gradients"].numpy()):
                self.log(warning)
            now = self.clock()
            if steady_step is None:
                first = now - start_time
                self.progress(f"train step compiled in {progress.format_duration(self._trace_secs + first)} (tracing "
                              f"{progress.format_duration(self._trace_secs)}, first step "
                              f"{progress.format_duration(first)}); rate and ETA from the steps after it")
                steady_step, steady_time = step, now
                log_step, log_time = step, now
            if step % tp.summary_interval_steps == 0 or step == tp.max_steps:
                values = {k: float(v) for k, v in metrics.items() if k not in _STATUS_KEYS}
                steps_per_sec = (step - summary_step) / max(now - summary_time, 1e-9)
                values.update(steps_per_sec=steps_per_sec, examples_per_sec=steps_per_sec * batch_size,
                              step_time=1.0 / max(steps_per_sec, 1e-9), **_memory_scalars())
                writer.scalars(step, values)
                summary_step, summary_time = step, now
            if step % tp.log_interval_steps == 0 or step == tp.max_steps:
                if step > log_step:
                    rate = (step - log_step) / max(now - log_time, 1e-9)
                    steady_rate = (step - steady_step) / max(now - steady_time, 1e-9)
                    speed = (f"examples/sec={rate * batch_size:.1f} "
                             f"eta={_format_eta((tp.max_steps - step) / max(steady_rate, 1e-9))}")
                else:  # only the compiling step so far
                    speed = "examples/sec=? eta=?"
                self.progress(f"step {step}/{tp.max_steps} loss={float(metrics['loss']):.4f} "
                              f"lr={float(metrics['learning_rate']):.3g} grad_norm={float(metrics['grad_norm']):.3g} "
                              f"{speed}")
                log_step, log_time = step, now
            if step % tp.save_interval_steps == 0 or step == tp.max_steps:
                self._save(step)
            if evaluate_every and step % evaluate_every == 0 and step < tp.max_steps and self.layout.is_chief:
                self._evaluate_current(step)
            # Several workers stop together, after the step whose reduced `stop` flag says one was signalled;
            # alone, a process stops right after the step it was signalled in.
            if bool(metrics["stop"]) or (self._stop_signal is not None and self.layout.num_workers == 1):
                self._save(step)
                cause = (f"signal {signal.Signals(self._stop_signal).name}" if self._stop_signal is not None
                         else "a signal to another worker")
                saved = "checkpoint saved" if self.layout.is_chief else "the chief saved a checkpoint"
                self.log(f"stopped by {cause} at step {step}; {saved}, run again to resume")
                return {k: float(v) for k, v in metrics.items() if k not in _MASK_KEYS}
        if evaluate_every is not None and self.layout.is_chief:
            self._evaluate_current(step)
        self._mark_done(step)
        skipped = (f", {self._skipped} of them skipped as non-finite (train.skip_nonfinite_steps)" if self._skipped
                   else "")
        self.progress(f"done: step {step}/{tp.max_steps}, {step - start_step} steps{skipped} in "
                      f"{progress.format_duration(self._trace_secs + self.clock() - start_time)} (compilation "
                      f"included); last checkpoint {self._last_checkpoint()}")
        return {k: float(v) for k, v in metrics.items() if k not in _MASK_KEYS}

    def _nonfinite(self, step: int, metrics: dict[str, Any], steps_run: int) -> None:
        bad = [name for name, b in zip(self.learner.gradient_names(), metrics["nonfinite_gradients"].numpy()) if b]
        what = f"the gradients of {_names(bad)}" if bad else "the loss (every gradient is finite)"
        if self.params.train.skip_nonfinite_steps:
            self._skipped += 1
            self._skipped_in_a_row += 1
            limit = self.params.train.max_consecutive_skipped_steps
            if self._skipped_in_a_row >= limit:
                raise TrainingError(f"steps {step - limit + 1}-{step} were all non-finite and skipped "
                                    f"(train.max_consecutive_skipped_steps={limit}; {self._skipped} of the "
                                    f"{steps_run} steps of this run skipped), last in {what}; stopped without "
                                    f"saving, so {self._quarantine_if_bad(limit)} is the last good state; lower "
                                    "the learning rate or clip gradients (train.clip_gradient_norm)")
            self.log(f"warning: non-finite loss or gradient at step {step}, in {what}; update skipped "
                     "(train.skip_nonfinite_steps)")
            return
        raise TrainingError(f"non-finite loss or gradient at step {step}, in {what}; stopped before "
                            f"updating, so {self._quarantine_if_bad(1)} is the last good state; lower "
                            "the learning rate, clip gradients (train.clip_gradient_norm) or set "
                            "--params=train.skip_nonfinite_steps=True")

    def _quarantine_if_bad(self, failed_batches: int) -> str:
        """The last good state after non-finite steps on `failed_batches` batches; returns its description.

        The failed steps all started from the weights of the last applied step (a skipped step changes none), which
        every checkpoint saved or restored since then holds: with train.skip_nonfinite_steps, checkpoints saved
        during the run of skipped steps too. If the steps failed on at least two batches (one more step is tried
        when only one failed: a single bad batch does not condemn the weights), the weights are the fault, e.g.
        finite but huge after a too-large learning rate: those checkpoints are moved to checkpoints/nonfinite/ (not
        deleted), so that a rerun resumes from the newest checkpoint before them instead of failing again.
        """
        latest = self._last_checkpoint()
        suspects = [p for p in self._holding_current_weights if os.path.exists(p + ".index")]
        if not suspects or not self.layout.is_chief or self.layout.num_workers > 1:
            return latest  # the newest checkpoint had a finite step after it (or there is none)
        if failed_batches < 2:
            batch = next(self.train_iterator, None)
            if batch is None or not bool(self.learner.train_step(batch, tf.constant(False))["nonfinite"]):
                return latest  # another batch takes a finite step from these weights (or there is none)
        previous = checkpoints.quarantine(self.logdir, suspects)
        moved = os.path.join(checkpoints.checkpoint_dir(self.logdir), checkpoints.QUARANTINE_DIR)
        batches = max(failed_batches, 2)
        if len(suspects) == 1:
            why = (f"{suspects[0]} gave non-finite steps from its own weights on {batches} batches, so it was moved "
                   f"to {moved}/ and a rerun resumes from the one before it")
        else:
            why = (f"{', '.join(suspects[:-1])} and {suspects[-1]} hold the same weights (saved while steps were "
                   f"skipped), which gave non-finite steps on {batches} batches, so they were moved to {moved}/ and a "
                   "rerun resumes from the one before them")
        return f"{previous or 'no checkpoint (a rerun starts from the initial values)'} ({why})"

    def _last_checkpoint(self) -> str:
        """The newest checkpoint this run saved or resumed from: one it knows to be finite and complete."""
        saved = self.manager.latest_checkpoint if self.manager is not None else None
        return saved or self._restored or "no checkpoint"

    def _mark_done(self, step: int) -> None:
        if not self.layout.is_chief:
            return
        with open(os.path.join(self.logdir, DONE_FILE), "w", encoding="utf-8") as f:
            f.write(f"{step}\n")

    # ----------------------------------------------------------------------------------------------- evaluation

    def _evaluate_current(self, step: int) -> dict[str, dict[str, float]]:
        ema = self.learner.ema if self.learner is not None else None
        # Training evaluates the weight averages, when kept, and then goes on from its own weights.
        with ema.averaged_weights() if ema is not None else contextlib.nullcontext():
            results = self._evaluate_datasets(step)
        if self._best is not None:
            self._best.consider(step, results)
        return results

    def _use_averages(self, path: str) -> None:
        """Eval of a restored checkpoint `path`: its weight averages, if it holds them, replace the weights."""
        self._ema_reader = weight_ema.maybe_use_averages(self.task, self.params.train, path, self.log,
                                                         self._ema_reader)

    def _evaluate_datasets(self, step: int) -> dict[str, dict[str, float]]:
        results = {}
        for name in self.params.eval.datasets:
            # One Evaluator (one traced eval step) per dataset for the whole run, not a retrace per evaluation.
            if name not in self._evaluators:
                self._evaluators[name] = Evaluator(self.task, name, self.params.input.get(name))
            evaluator = self._evaluators[name]
            phase = progress.Phase(self.progress, f"eval {name} at step {step}", evaluator.num_batches,
                                   clock=self.clock)
            values = evaluator.run(on_batch=phase.update)
            seconds = phase.finish()
            writer = SummaryWriter(self.logdir, f"eval_{name}")
            writer.scalars(step, values)
            writer.close()
            hparams.write_metrics(self.logdir, step, {f"eval_{name}/{k}": v for k, v in values.items()})
            self.log(f"eval {name} at step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in sorted(values.items()))
                     + f" ({progress.format_duration(seconds)})")
            results[name] = values
        return results

    def evaluate(self, follow: bool = False, poll_secs: float = 2.0, timeout_secs: float = 3600.0,
                 chosen: str | None = None) -> dict[int, dict[str, dict[str, float]]]:
        """Evaluates checkpoints on every dataset in eval.datasets; writes logdir/eval_<name>.

        Without `follow`: the newest checkpoint that restores completely, once; no checkpoint is a ConfigError
        (a mistyped --logdir must not evaluate random weights). With `follow`:
        every checkpoint, oldest first, each exactly once, as the trainer writes them, until the trainer marks
        the run done and its last checkpoint is evaluated, or no new checkpoint appears for `timeout_secs`.
        `chosen` (--checkpoint): evaluate that checkpoint once (a ckpt-N prefix or a run's logdir), whatever
        `follow`; ConfigError naming it when it cannot be read. Read-only: the evaluator never writes into the
        trainer's checkpoint directory.
        """
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        checkpoint = tf.train.Checkpoint(task=self.task, global_step=global_step)
        results: dict[int, dict[str, dict[str, float]]] = {}
        if chosen:
            path = checkpoints.restore_chosen(checkpoint, chosen)
            self.log(f"evaluating {path}")
            self._use_averages(path)
            self._check_eval_dirs_writable()
            step = int(global_step.numpy())
            results[step] = self._evaluate_current(step)
            return results
        if not follow:
            path = checkpoints.restore_latest(checkpoint, self.logdir, partial=True, warn=self.log)
            if path is None:
                raise ConfigError(f"no checkpoint in {checkpoints.checkpoint_dir(self.logdir)} to evaluate; check "
                                  "--logdir, or train first (or drop --eval_once to wait for the trainer's "
                                  "checkpoints)")
            self._use_averages(path)
            self._check_eval_dirs_writable()
            step = int(global_step.numpy())
            results[step] = self._evaluate_current(step)
            return results
        last_new = time.time()
        waiting = False
        unreadable: set[str] = set()
        while True:
            pending = [p for p in checkpoints.checkpoint_paths(self.logdir) if checkpoints.step_of(p) not in results]
            progressed = False
            for path in pending:
                if path in unreadable:
                    continue
                reason = self._restore_for_eval(checkpoint, path)
                if reason is not None:
                    if os.path.exists(path + ".index"):  # not merely deleted by max_checkpoints_to_keep
                        self.log(f"warning: checkpoint {path} is unreadable ({reason}); not evaluated")
                        unreadable.add(path)
                    continue
                if not results:  # only now: following a mistyped --logdir must not create it
                    self._check_eval_dirs_writable()
                results[checkpoints.step_of(path)] = self._evaluate_current(checkpoints.step_of(path))
                last_new = time.time()
                progressed = True
            done = self._done_step()
            if done is not None and (done in results or os.path.join(
                    checkpoints.checkpoint_dir(self.logdir), f"ckpt-{done}") in unreadable):
                return results
            if not progressed and not waiting:
                left = timeout_secs - (time.time() - last_new)
                self.log(f"waiting for a new checkpoint in {checkpoints.checkpoint_dir(self.logdir)} (evaluated "
                         f"so far: {sorted(results) or 'none'}; the evaluator stops when the trainer writes "
                         f"{DONE_FILE} or after {max(left, 0):.0f} s more without one; --eval_timeout_secs)")
                waiting = True
            if time.time() - last_new > timeout_secs:
                self.log(f"no new checkpoint for {timeout_secs:.0f} s; evaluator stops")
                return results
            if not progressed:
                time.sleep(poll_secs)
            else:
                waiting = False

    def _restore_for_eval(self, checkpoint: tf.train.Checkpoint, path: str) -> str | None:
        """Restores checkpoint `path` (and its weight averages) into `checkpoint`; returns why it cannot be read
        back (None: restored). A trainer beside the evaluator may delete it meanwhile (max_checkpoints_to_keep)."""
        reason = checkpoints.unreadable_reason(path)
        if reason is not None:
            return reason
        try:
            checkpoints.restore(checkpoint, path, partial=True)
            try:
                self._use_averages(path)
            except ConfigError as e:  # saved before the run turned averaging on
                self.log(f"warning: {e}; evaluating {path} with its trained weights")
        except tf.errors.OpError as e:
            return " ".join(str(e).split())[:300]
        return None

    def _check_eval_dirs_writable(self) -> None:
        for name in self.params.eval.datasets:
            logdir_lib.check_writable(os.path.join(self.logdir, f"eval_{name}"), what="evaluation summaries")

    def _done_step(self) -> int | None:
        path = os.path.join(self.logdir, DONE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                return int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return None
