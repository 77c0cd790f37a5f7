"""The train step: loss and gradients from the task, clipping, learning rate, optimizer update.

This is the step logic only; when to run it, checkpoint and summarize is the controller's business
(Orbit's split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, placement
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.layers import stateless_random
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext
from gpipe_tf.tasks.base_task import BaseTask, Metrics
from gpipe_tf.training import init_from, keep_best, lr_schedules, optimizers, xla_step
from gpipe_tf.training import loss_scale as loss_scale_lib
from gpipe_tf.training import weight_ema as weight_ema_lib
from gpipe_tf.training.replicas import ReplicaLayout


def training_params() -> Params:
    """Default Params of the `train` subtree: optimization and training-loop settings."""
    p = Params()
    p.define("max_steps", 1000, "Train until the global step reaches this value.")
    p.define("learning_rate", 1e-3, "Base learning rate; the schedule multiplies it.")
    p.define("optimizer", optimizers.Adam.params(), "Optimizer Params (SGD, Adam, AdamW, RMSProp, Adafactor).")
    p.define("lr_schedule", lr_schedules.Constant.params(),
             "Learning-rate multiplier schedule (Constant, LinearWarmupRsqrtDecay, Cosine, StepDecay); a decay "
             "length left None follows max_steps.")
    p.define("ema_decay", 0.0, "Exponential moving average of the trained weights, in [0, 1); 0: off. When on, "
             "evaluation, decoding and export use the averaged weights (docs/experiments.md#weight-averages).")
    p.define("keep_best_metric", "", "--mode=train_and_eval: keep the checkpoint with the best value of this eval "
             "metric in logdir/best ('accuracy': of the first eval dataset; 'dev/loss': of dataset dev); '' off.")
    p.define("keep_best_mode", "auto", "Which way keep_best_metric is better: 'max' (e.g. accuracy), 'min' (e.g. "
             "loss) or 'auto': 'min' for a metric named like a loss, error or perplexity (keep_best.LOWER_IS_BETTER), "
             "else 'max'.")
    p.define("clip_gradient_norm", 0.0, "Clip gradients to this global norm; 0 disables clipping.")
    p.define("seed", 1, "The run seed: dropout at step s uses the stateless seed (seed, s), and any value but 1 also "
             "derives task.seed (initialization) and input.train.seed (data order) unless --params sets them "
             "(gpipe_tf/training/run_seed.py).")
    p.define("save_interval_steps", 100, "Write a checkpoint every this many steps (and at the end).")
    p.define("max_checkpoints_to_keep", 5, "Older checkpoints are deleted.")
    p.define("init_from", init_from.init_from_params(), "Fine-tuning: initialize a new run's variables from another "
             "run's checkpoint by name rules (docs/fine_tuning.md).")
    p.define("summary_interval_steps", 10, "Write TensorBoard scalars every this many steps.")
    p.define("log_interval_steps", 50, "Print a progress line every this many steps.")
    p.define("eval_interval_steps", 0, "--mode=train_and_eval: evaluate every this many steps (0: at the end).")
    p.define("num_replicas", 1, "Data-parallel replicas of the model (each a whole pipeline) in this process: "
             "replica r's stage k on device r*K+k; the global batch is split over the replicas of all processes "
             "and their gradients all-reduced (docs/scaling_out.md).")
    p.define("skip_nonfinite_steps", False, "On a NaN/Inf loss or gradient: False stops training (the last good "
             "checkpoint stays the latest); True skips that step's update and goes on.")
    p.define("max_consecutive_skipped_steps", 10, "With skip_nonfinite_steps: stop (exit 1, nothing saved) when "
             "this many steps in a row were non-finite and skipped; a run that only skips would train nothing.")
    p.define("loss_scale", loss_scale_lib.loss_scale_params(), "Loss scaling for float16 computation (method auto: "
             "dynamic when a layer's fprop_dtype is float16). The scale and the skipped-step count are written to "
             "TensorBoard as loss_scale and skipped_steps (docs/precision.md#float16-and-loss-scaling).")
    p.define("jit_compile", False, "Compile the whole train step as one XLA program: every variable on one device "
             "(K=1, or every stage on one device). A pipeline over several devices compiles each stage on its own "
             "device instead: task.network.jit_compile (docs/accelerators.md).")
    return p


# The largest global step: the step counter is an int64 variable.
MAX_STEP = 2 ** 63 - 1
# train.* counts and their smallest allowed values.
_MINIMUM = {"max_steps": 1, "save_interval_steps": 1, "max_checkpoints_to_keep": 1, "summary_interval_steps": 1,
            "log_interval_steps": 1, "eval_interval_steps": 0, "num_replicas": 1, "max_consecutive_skipped_steps": 1}


def check_training_params(tp: Params) -> None:
    """Raises ParamsError naming the first train.* count below its minimum (e.g. save_interval_steps=0)."""
    for name, minimum in _MINIMUM.items():
        value = tp.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ParamsError(f"train.{name}={value!r} must be an integer >= {minimum}; set "
                              f"--params=train.{name}=N with N >= {minimum}")
        if value > MAX_STEP:
            raise ParamsError(f"train.{name}={value} is above {MAX_STEP}, the largest int64 step; use a smaller "
                              "value")
    if not isinstance(tp.jit_compile, bool):
        raise ParamsError(f"train.jit_compile={tp.jit_compile!r} must be True or False: True compiles the whole step "
                          "with XLA on one device, False (the default) runs TensorFlow's kernels")
    init_from.check(tp.init_from)
    if not tp.learning_rate >= 0.0:
        raise ParamsError(f"train.learning_rate={tp.learning_rate!r} must be >= 0")
    loss_scale_lib.check_loss_scale_params(tp.loss_scale)
    weight_ema_lib.check_decay(tp.ema_decay)
    if tp.keep_best_mode not in keep_best.MODES:
        raise ParamsError(f"train.keep_best_mode={tp.keep_best_mode!r} must be one of {', '.join(keep_best.MODES)}; "
                          "set --params=train.keep_best_mode=min for a metric such as loss, or auto to choose by "
                          "the metric's name")
    if not isinstance(tp.keep_best_metric, str):
        raise ParamsError(f"train.keep_best_metric={tp.keep_best_metric!r} must be a metric name such as "
                          "'accuracy' or 'dev/accuracy', or '' (off)")


def precision_of(layers: Sequence[BaseLayer], loss_scale_method: str, loss_scale: Params) -> dict[str, str]:
    """What a step computes in, by name: the variables' dtypes, the forward pass's dtypes (`fprop_dtype`, several
    joined by '+') and the loss scaling in effect ('none', 'fixed 32768' or 'dynamic from 32768')."""
    def names(dtypes: set[tf.DType]) -> str:
        return "+".join(sorted(d.name for d in dtypes)) or "none"

    scale = f"{loss_scale.initial_scale:g}"
    scaling = {"none": "none", "fixed": f"fixed {scale}", "dynamic": f"dynamic from {scale}"}[loss_scale_method]
    return {"weight_dtype": names({m.dtype for m in layers}), "compute_dtype": names({m.fprop_dtype for m in layers}),
            "loss_scale": scaling}


def describe_precision(precision: Mapping[str, str]) -> str:
    """The console line naming a run's precision, e.g. 'precision: weights float32, compute bfloat16, loss
    scaling none'."""
    return (f"precision: weights {precision['weight_dtype']}, compute {precision['compute_dtype']}, "
            f"loss scaling {precision['loss_scale']}")


class Learner(tf.Module):
    """Owns the global step, optimizer and learning-rate schedule for one task; `train_step` is one `tf.function`
    step."""

    def __init__(self, task: BaseTask, train_params: Params, layout: ReplicaLayout | None = None) -> None:
        super().__init__(name="learner")
        check_training_params(train_params)
        self.task = task
        self.tp = train_params
        self.layout = layout or ReplicaLayout()
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.optimizer = train_params.optimizer.instantiate()
        self.lr_schedule = lr_schedules.for_run(train_params.lr_schedule, train_params.max_steps)
        self.variables_to_train = list(task.trainable_variables)
        layers = [m for m in (task, *task.submodules) if isinstance(m, BaseLayer)]
        self._stat_layers = [m for m in layers if type(m).apply_aux_stats is not BaseLayer.apply_aux_stats]
        self._stepped_layers = [m for m in layers if type(m).set_training_step is not BaseLayer.set_training_step]
        # 'none', 'fixed' or 'dynamic': train.loss_scale.method with 'auto' resolved by the layers' dtypes.
        method = self.loss_scale_method = loss_scale_lib.resolve_method(train_params.loss_scale,
                                                                        {m.fprop_dtype for m in layers})
        self.precision = precision_of(layers, method, train_params.loss_scale)
        self.loss_scale = (None if method == "none" else
                           loss_scale_lib.LossScale(train_params.loss_scale, method))
        # Slots are created now, eagerly, next to their variables: never inside the traced step.
        self.optimizer.build(self.variables_to_train)
        self.ema = (weight_ema_lib.WeightEma(self.variables_to_train, train_params.ema_decay)
                    if train_params.ema_decay else None)
        if train_params.jit_compile:
            xla_step.check_one_device(self.variables, layers)  # the task's, the optimizer's and the learner's
            compiled = tf.function(self._train_step, autograph=False, jit_compile=True)
            self.train_step = tf.function(
                lambda batch, stop_requested=None: compiled(xla_step.compilable_batch(batch), stop_requested),
                autograph=False)
        else:
            self.train_step = tf.function(self._train_step, autograph=False)
        # The names of the task's metrics (what evaluation reports too), known once the step has been traced.
        self.task_metric_names: tuple[str, ...] = ()

    def learning_rate(self, step: tf.Tensor) -> tf.Tensor:
        """The learning rate at `step`: base rate times the learning-rate schedule's multiplier."""
        return tf.cast(self.tp.learning_rate, tf.float32) * self.lr_schedule(step)

    def _train_step(self, batch: Mapping[str, tf.Tensor], stop_requested: tf.Tensor | None = None
                    ) -> dict[str, tf.Tensor]:
        # stop_requested: this process was asked to stop (a signal); the step reports `stop` when any process
        # of the run was, so all of them stop after the same step.
        stop_requested = tf.constant(False) if stop_requested is None else stop_requested
        step = self.global_step.read_value()
        for layer in self._stepped_layers:
            layer.set_training_step(step)
        seed = tf.stack([tf.constant(self.tp.seed, tf.int64), step])
        scale = None if self.loss_scale is None else self.loss_scale.scale.read_value()
        loss, metrics, grads, aux, stop = self._loss_and_gradients(batch, seed, stop_requested, scale)
        self.task_metric_names = tuple(sorted(metrics))
        # A NaN/Inf loss or gradient must not reach the variables: the update is skipped and the step reports
        # every non-finite gradient (a mask in variable order, not a "first" that depends on which check ran
        # first), so the controller can stop or go on with a deterministic message.
        finite = [tf.constant(True) if g is None else tf.reduce_all(tf.math.is_finite(g)) for g in grads]
        grads_ok = tf.stack(finite) if finite else tf.ones([0], tf.bool)
        # Every element exactly zero (float16 underflow, or no path from the loss): zero_gradients.ZeroGradientWatch.
        zero = [tf.constant(True) if g is None else
                tf.reduce_all(tf.equal(g.values if isinstance(g, tf.IndexedSlices) else g, 0)) for g in grads]
        grads_zero = tf.stack(zero) if zero else tf.ones([0], tf.bool)
        all_finite = tf.logical_and(tf.reduce_all(tf.math.is_finite(loss)), tf.reduce_all(grads_ok))
        report_nonfinite = tf.logical_not(all_finite)
        if self.loss_scale is not None:
            # An overflow of the scaled float16 backward is expected now and then: dynamic scaling skips the
            # step and lowers the scale instead of reporting it (the loss itself is float32, checked as usual).
            expected = tf.logical_and(tf.reduce_all(tf.math.is_finite(loss)),
                                      self.loss_scale.is_expected_overflow(tf.reduce_all(grads_ok)))
            report_nonfinite = tf.logical_and(report_nonfinite, tf.logical_not(expected))
            self.loss_scale.update(all_finite)
        grads, grad_norm = optimizers.clip_by_global_norm(grads, self.tp.clip_gradient_norm)
        lr = self.learning_rate(step)

        def update() -> tf.Tensor:
            # Once per step, from the whole mini-batch: batch norm moving averages (never inside fprop).
            for layer in self._stat_layers:
                layer.apply_aux_stats(aux)
            applied = self.optimizer.apply_gradients(zip(grads, self.variables_to_train), lr)
            if self.ema is not None:
                with tf.control_dependencies([] if applied is None else [applied]):  # of the updated weights
                    self.ema.update()
            return tf.constant(True)

        tf.cond(all_finite, update, lambda: tf.constant(False))
        self.global_step.assign_add(1)
        out = {name: tf.cast(value, tf.float32) for name, (value, _) in metrics.items()}
        out.update(loss=tf.cast(loss, tf.float32), grad_norm=tf.cast(grad_norm, tf.float32), learning_rate=lr,
                   var_norm=tf.cast(tf.linalg.global_norm(self.variables_to_train), tf.float32),
                   nonfinite=report_nonfinite, nonfinite_gradients=tf.logical_not(grads_ok),
                   zero_gradients=grads_zero, stop=stop)
        if self.loss_scale is not None:
            out.update(loss_scale=self.loss_scale.scale.read_value(),
                       skipped_steps=tf.cast(self.loss_scale.skipped_steps.read_value(), tf.float32))
        if self.tp.jit_compile:  # while tracing, before XLA compiles (and could silently get) any of it
            xla_step.refuse_uncompilable(tf.compat.v1.get_default_graph())
        return out

    def checkpointed(self) -> dict[str, tf.Module]:
        """State of the learner besides the optimizer that checkpoints must hold: the loss scale and the weight
        averages, when used."""
        state: dict[str, tf.Module] = {} if self.loss_scale is None else {"loss_scale": self.loss_scale}
        if self.ema is not None:
            state[weight_ema_lib.CHECKPOINT_KEY] = self.ema
        return state

    def _loss_and_gradients(self, batch: Mapping[str, tf.Tensor], seed: tf.Tensor, stop: tf.Tensor,
                            loss_scale: tf.Tensor | None = None
                            ) -> tuple[tf.Tensor, Metrics, list[tf.Tensor | None], dict[str, Any], tf.Tensor]:
        """Loss, metrics, gradients, batch-norm statistics and the stop request of the global batch.

        `loss_scale`: each replica's backward pass differentiates its loss times it, and its gradients are
        divided by it before they are combined (`BaseTask.loss_and_gradients`).

        With several replicas each computes its slice's weighted-mean loss; they are combined with the slices'
        loss weights (metrics['loss'][1], e.g. real target tokens), so D replicas take the same step as one model
        on the whole batch even when slices hold different numbers of real examples. `stop`: this process asks
        the run to stop after this step; the result is True when any process asked.
        """
        layout = self.layout
        # Only with a scale: a task overriding loss_and_gradients without loss scaling keeps working.
        scaling = {} if loss_scale is None else {"loss_scale": loss_scale}
        if layout.num_replicas == 1:
            ctx = FPropContext(training=True, seed=seed, aux={})
            loss, metrics, grads = self.task.loss_and_gradients(batch, ctx, **scaling)
            return loss, metrics, grads, ctx.aux, stop
        size = microbatch.batch_size(batch)
        if size % layout.num_replicas:
            raise ParamsError(f"global batch size {size} is not divisible by the {layout.num_replicas} data-parallel "
                              f"replicas; use a batch size that is a multiple of {layout.num_replicas} (times "
                              "num_micro_batches)")
        slices = microbatch.split_list(batch, layout.num_replicas)
        runs = []
        for r in range(layout.local_replicas):
            g = layout.first_replica + r
            # Each replica draws its own dropout masks: the step's seed folded with the global replica index.
            ctx = FPropContext(training=True, seed=stateless_random.fold_in(seed, g), aux={})
            with tf.device(layout.home_devices[r]), placement.on_replica(r):
                loss, metrics, grads = self.task.loss_and_gradients(slices[g], ctx, **scaling)
            runs.append((loss, metrics, grads, ctx.aux))
        loss0, metrics0, grads0, aux0 = runs[0]
        names = sorted(metrics0)
        present = [i for i, g in enumerate(grads0) if g is not None]
        parts = []
        for r, (loss, metrics, grads, aux) in enumerate(runs):
            weight = metrics["loss"][1] if "loss" in metrics else tf.ones([], loss.dtype)
            parts.append([loss * tf.cast(weight, loss.dtype), tf.cast(weight, loss.dtype)]
                         + [metrics[n][0] * tf.cast(metrics[n][1], metrics[n][0].dtype) for n in names]
                         + [tf.cast(metrics[n][1], metrics[n][0].dtype) for n in names]
                         + [grads[i] * tf.cast(weight, grads[i].dtype) for i in present]
                         # Batch-norm statistics are sums (sum, sum of squares, count): they add up.
                         + tf.nest.flatten(aux)
                         + [tf.cast(stop if r == 0 else False, tf.float32)])
        sums = layout.all_reduce(tf.distribute.ReduceOp.SUM, parts)
        total_weight = sums[1]
        loss = tf.math.divide_no_nan(sums[0], total_weight)
        n = len(names)
        metrics = {name: (tf.math.divide_no_nan(sums[2 + j], sums[2 + n + j]), sums[2 + n + j])
                   for j, name in enumerate(names)}
        reduced = list(grads0)
        for j, i in enumerate(present):
            reduced[i] = tf.math.divide_no_nan(sums[2 + 2 * n + j], tf.cast(total_weight, sums[2 + 2 * n + j].dtype))
        aux = tf.nest.pack_sequence_as(aux0, sums[2 + 2 * n + len(present):-1])
        return loss, metrics, reduced, aux, sums[-1] > 0

    def gradient_names(self) -> list[str]:
        """Names of the trained variables (without ':0'), in the order of the `nonfinite_gradients` mask."""
        return [v.name.rsplit(":", 1)[0] for v in self.variables_to_train]

    @tf.function(autograph=False)
    def nonfinite_variables(self) -> tf.Tensor:
        """A mask over `variables_to_train`: True where a variable holds a NaN or Inf."""
        return tf.stack([tf.logical_not(tf.reduce_all(tf.math.is_finite(v))) for v in self.variables_to_train])
