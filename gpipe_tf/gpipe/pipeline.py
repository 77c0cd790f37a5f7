"""The GPipe layer: a layer sequence split into K stages on K devices, run over M micro-batches.

The layer takes its stage plan (`plan.py`: balance, layer names, costs, remat, devices), builds each stage's
layers on the stage's device, and hands one mini-batch at a time to a schedule. Two schedules build GPipe's
fill-drain order; both keep every stage's weights, weight-gradient sums, stashes and recomputation on the stage's
device and send only stage-boundary activations and their gradients between devices:

* ``fill_drain`` (`fill_drain.py`): one while loop over micro-batches and TensorFlow's gradient of it; graph and
  trace time constant in M.
* ``unrolled`` (`unrolled_scheduler.py`): every (stage, micro-batch) step is its own op group with an explicit
  backward order; the graph grows with M, but on single-thread TF workers its backward overlaps the stages
  better (README "How the pipeline works" has the figures).

Randomness: micro-batch i runs with the step's seed folded with i; each layer folds in its own id, derived from
its global index in the sequence, so masks do not depend on K and recomputation repeats them.
"""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from gpipe_tf.gpipe import fill_drain, microbatch, partition, placement, remat, unrolled_scheduler
from gpipe_tf.gpipe.plan import StagePlan, make_plan
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext
from gpipe_tf.layers.sequential import Sequential


SCHEDULERS = {"unrolled": unrolled_scheduler.run, "fill_drain": fill_drain.run}


class GPipe(BaseLayer):
    """Runs `layers` as a K-stage pipeline over M micro-batches; numerically the same as running them in order."""

    # Gradient accumulators are scratch space, not model state: kept out of checkpoints and variable lists.
    _TF_MODULE_IGNORED_PROPERTIES = (frozenset(("gradient_sums", "replica_gradient_sums"))
                                     | BaseLayer._TF_MODULE_IGNORED_PROPERTIES)

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: the layer list, K, M, balance, remat and devices."""
        p = super().params()
        p.define("layers", [], "Layer Params, in order. Each layer's output is the next one's input.")
        p.define("num_stages", 1, "K: pipeline stages, one per device.")
        p.define("num_micro_batches", 1, "M: micro-batches per mini-batch; must divide the batch size.")
        p.define("balance", None, "Layers per stage, e.g. [3, 5]; None: balanced automatically by balance_by.")
        p.define("balance_by", "params", f"Automatic balancing cost: one of {partition.BALANCE_BY}.")
        p.define("micro_batch_shape", None,
                 "Shape of one micro-batch of the first layer's input (with batch dim), for balance_by "
                 "'flops' or 'time'.")
        p.define("input_dtype", "float32", "dtype of that input, for balance_by 'flops' or 'time'.")
        p.define("remat", "never", f"Rematerialization policy: one of {remat.POLICIES}.")
        p.define("device_kind", "auto", f"Stage devices: one of {placement.DEVICE_KINDS}.")
        p.define("devices", None, "Explicit device strings, one per stage (or D lists of K for D replicas); "
                 "overrides device_kind.")
        p.define("schedule", "fill_drain", f"How the fill-drain schedule is built: one of {tuple(SCHEDULERS)}. "
                 "'fill_drain' (default): one while loop over micro-batches; graph and trace time constant in M, "
                 "each stage's state on its device. 'unrolled': every (stage, micro-batch) step is its own op "
                 "group; the graph grows with M x layers (README 'How the pipeline works' compares them).")
        p.define("input_gradients", "auto", "Compute the gradient of the pipeline's input? 'auto': only if the "
                 "input is computed from variables (a data batch needs none); True when you watch the input "
                 "yourself (e.g. saliency maps).")
        p.define("parallel_iterations", 1, "schedule='fill_drain': loop iterations (micro-batches) each device runs at "
                 "once. 1 (default): a stage works on one micro-batch at a time while the other stages work on "
                 "theirs; higher values measured no faster on single-thread workers and use more memory.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.num_micro_batches < 1:
            raise ParamsError(f"{self.path}.num_micro_batches={p.num_micro_batches} must be >= 1")
        if p.schedule not in SCHEDULERS:
            raise ParamsError(f"{self.path}.schedule={p.schedule!r} is not one of {tuple(SCHEDULERS)}")
        if not isinstance(p.parallel_iterations, int) or p.parallel_iterations < 1:
            raise ParamsError(f"{self.path}.parallel_iterations={p.parallel_iterations!r} must be a whole number "
                              ">= 1; use 1 (the default)")
        # D data-parallel replicas (train.num_replicas; the trainer builds the task inside placement.replicas(D)):
        # replica r's stage k on device r*K+k, each with its own gradient sums.
        self.plan: StagePlan = make_plan(p, num_replicas=placement.num_replicas(), path=self.path)
        self.replica_devices = [list(devices) for devices in self.plan.devices]
        self.devices = self.replica_devices[0]
        self.replica_scopes = []
        for devices in self.replica_devices:
            pipeline_id = placement.new_pipeline_id()
            self.replica_scopes.append([placement.stage_scope(pipeline_id, s, d) for s, d in enumerate(devices)])
        self.stage_scopes = self.replica_scopes[0]
        for stage, names in enumerate(self.plan.stage_layers):
            with tf.device(self.devices[stage]):
                for j, name in zip(self.plan.layer_indices(stage), names):
                    self.create_child(name, p.layers[j])
        counts = [sum(v.shape.num_elements() for n in names for v in self.children[n].trainable_variables)
                  for names in self.stage_layers]
        # One gradient sum per weight and replica, on the replica's stage device, allocated once: the unrolled
        # schedule adds each micro-batch's weight gradient into it in place (fill_drain sums in loop variables).
        replica_sums: list[list[list[tf.Variable]]] = []
        # object.__setattr__ bypasses checkpoint tracking; the ignored-properties set hides them from .variables.
        object.__setattr__(self, "replica_gradient_sums", replica_sums)
        for r, devices in enumerate(self.replica_devices if p.schedule == "unrolled" else []):
            sums = []
            for stage, names in enumerate(self.stage_layers):
                with tf.device(devices[stage]):
                    flat = tf.nest.flatten({n: self.children[n].theta for n in names})
                    sums.append([tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                             name=f"{self.path}/gradient_sum_{r}_{stage}_{j}")
                                 for j, v in enumerate(flat)])
            replica_sums.append(sums)
        object.__setattr__(self, "gradient_sums", replica_sums[0] if replica_sums else [])
        stage_costs = self.plan.stage_costs()
        self.partition_rows = [
            partition.StageInfo(stage=s, layers=names, params=counts[s], remat=self.plan.remat[s],
                                device=" ".join(devices[s] for devices in self.replica_devices),
                                cost=None if stage_costs is None else stage_costs[s])
            for s, names in enumerate(self.stage_layers)]

    @property
    def balance(self) -> list[int]:
        """Layers per stage, from the plan."""
        return list(self.plan.balance)

    @property
    def stage_layers(self) -> list[list[str]]:
        """Each stage's layer names (``layer_{j}``, j the global index), from the plan."""
        return [list(names) for names in self.plan.stage_layers]

    def replica(self, index: int) -> "GPipe | PipelineReplica":
        """The pipeline as local replica `index` runs it: its own devices, stage scopes and gradient sums."""
        if not 0 <= index < len(self.replica_devices):
            raise ParamsError(f"{self.path}: replica {index} does not exist; this pipeline was built with "
                              f"{len(self.replica_devices)} (train.num_replicas)")
        return self if index == 0 else PipelineReplica(self, index)

    def partition_table(self) -> str:
        """The chosen split as text: stage, layers, params, remat, device, cost."""
        return partition.format_table(self.partition_rows, f"cost({self.plan.cost_kind or 'none'})")

    def _run_stage(self, stage: int, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        out = inputs
        for name in self.stage_layers[stage]:
            out = self.children[name].fprop(theta[name], out, ctx)
        return out

    def _output_structure(self, micro_batch_spec: Any) -> Any:
        """Output TensorSpecs of one micro-batch, from Params where layers can tell, else by tracing."""
        spec = micro_batch_spec
        try:
            for names in self.stage_layers:
                for name in names:
                    child = self.children[name]
                    spec = child.output_spec(child.p, spec)
            return spec
        except NotImplementedError:
            pass
        ctx = FPropContext(training=False)
        traced = tf.function(lambda x: self._run_all(self.theta, x, ctx)).get_concrete_function(micro_batch_spec)
        return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), traced.structured_outputs)

    def _run_all(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        for stage in range(self.p.num_stages):
            inputs = self._run_stage(stage, theta, inputs, ctx)
        return inputs

    def micro_batch_context(self, ctx: FPropContext, index: Any, collect_aux: bool) -> FPropContext:
        """The context of micro-batch `index`: the step's seed folded with the index, its own aux dict."""
        seed = None if ctx.seed is None else tf.random.experimental.stateless_fold_in(
            tf.cast(ctx.seed, tf.int64), tf.cast(index, tf.int64))
        return FPropContext(training=ctx.training, seed=seed, aux={} if collect_aux else None)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """Runs the pipeline on a mini-batch (any nested structure with a common leading batch dimension)."""
        microbatch.check_divisible(inputs, self.p.num_micro_batches)
        pipe = self.replica(placement.current_replica())
        # Weights are read once per step on their stage's device and enter the schedule as tensors.
        stage_theta = []
        for stage, names in enumerate(self.stage_layers):
            with tf.device(pipe.devices[stage]):
                stage_theta.append({n: tf.nest.map_structure(tf.identity, theta[n]) for n in names})
        scheduler = SCHEDULERS[self.p.schedule]
        return scheduler(pipe, stage_theta, inputs, ctx)

    # Costs from Params alone are those of the same layers run in sequence.
    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Sum of the layers' counts."""
        return Sequential.num_params(p)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> Any:
        """Each layer's output spec feeds the next."""
        return Sequential.output_spec(p, input_spec)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Sum of the layers' flops."""
        return Sequential.flops(p, input_spec)


class PipelineReplica:
    """A GPipe layer seen as one of its data-parallel replicas: the same layers and weights, run on the replica's
    own devices with its own stage scopes and gradient sums (what the schedulers read)."""

    def __init__(self, pipe: GPipe, index: int) -> None:
        self._pipe = pipe
        self.index = index
        self.devices = pipe.replica_devices[index]
        self.stage_scopes = pipe.replica_scopes[index]
        self.gradient_sums = pipe.replica_gradient_sums[index] if pipe.replica_gradient_sums else []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)
