"""The GPipe layer: a layer sequence split into K stages on K devices, run over M micro-batches.

The layer takes its stage plan (`plan.py`: balance, layer names, costs, remat, devices), builds each stage's
layers on the stage's device, and hands one mini-batch at a time to its schedule as plain data (`PipelineJob`,
`schedule_base.py`). Two schedules build GPipe's fill-drain order; both keep every stage's weights, weight-gradient
sums, stashes and recomputation (`remat.py`) on the stage's device and send only stage-boundary activations and
their gradients between devices:

* `FillDrain` (`fill_drain.py`, the default): one while loop over micro-batches and TensorFlow's gradient of it;
  graph and trace time constant in M.
* `Unrolled` (`unrolled.py`): every (stage, micro-batch) step is its own op group with an explicit backward
  order; the graph grows with M, and its weight-gradient sums add in place (docs/pipeline.md#schedules compares
  the two).

The other schedules (`schedules.py` names them all) run other orders in the loop of `windowed_loop.py`.

Randomness: micro-batch i runs with the step's seed folded with i; each layer folds in its own id, derived from
its global index in the sequence, so masks do not depend on K and recomputation repeats them.

Mixed precision (`fprop_dtype` bfloat16 or float16, float32 variables): the pipeline's floating inputs are cast to
`fprop_dtype`, so every stage-boundary activation and its gradient crosses devices in half precision; each stage
casts its float32 weights inside its own step, per micro-batch, so the schedules sum weight gradients in float32.
(A cast once per step, before the schedule, would make the schedule sum them in half precision.) The cost: with
remat 'never' the backward keeps each micro-batch's half-precision copy of the stage's weights with its
activations; a recomputing stage casts again in its backward and keeps nothing more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, partition, placement, remat, xla_cells
from gpipe_tf.gpipe.fill_drain import FillDrain
from gpipe_tf.gpipe.leaves import depends_on_variables, float_leaves
from gpipe_tf.gpipe.plan import StagePlan, make_plan
from gpipe_tf.gpipe.schedule_base import PipelineJob, PipelineLoss, Schedule
from gpipe_tf.gpipe.schedules import SCHEDULES, schedule_help, schedule_params  # noqa: F401 (re-exported)
from gpipe_tf.hyperparams import InstantiableParams, Params, ParamsError
from gpipe_tf.layers import stateless_random
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, inherited_dtypes, with_inherited_dtypes
from gpipe_tf.layers.sequential import Sequential


class GPipe(BaseLayer):
    """Runs `layers` as a K-stage pipeline over M micro-batches; numerically the same as running them in order."""

    # The schedule's state (e.g. gradient sums) is scratch space, not model state: kept out of checkpoints and
    # variable lists.
    _TF_MODULE_IGNORED_PROPERTIES = frozenset(("schedule",)) | BaseLayer._TF_MODULE_IGNORED_PROPERTIES

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: the layer list, K, M, balance, remat and devices."""
        p = super().params()
        p.define("layers", [], "Layer Params, in order. Each layer's output is the next one's input.")
        p.define("num_stages", 1, "K: pipeline stages, one per device (the Interleaved and ZeroBubbleV schedules "
                 "cut the layers into v chunks per device).")
        p.define("num_micro_batches", 1, "M: micro-batches per mini-batch; must divide the batch size.")
        p.define("balance", None, "Layers per stage, e.g. [3, 5]; None: balanced automatically by balance_by.")
        p.define("balance_by", "params", f"Automatic balancing cost: one of {partition.BALANCE_BY}.")
        p.define("micro_batch_shape", None,
                 "Shape of one micro-batch of the first layer's input (with batch dim), for balance_by "
                 "'flops' or 'time' and the memory planner; a list of shapes for a pipeline fed several tensors.")
        p.define("input_dtype", "float32", "dtype of that input, for balance_by 'flops' or 'time' and the memory "
                 "planner; with several input shapes, one dtype for all or a list of one per shape.")
        p.define("remat", "never", f"Rematerialization policy: one of {remat.POLICIES}.")
        p.define("device_kind", "auto", f"Stage devices: one of {placement.DEVICE_KINDS}.")
        p.define("devices", None, "Explicit device strings, one per stage (or D lists of K for D replicas); "
                 "overrides device_kind.")
        p.define("schedule", FillDrain.params(), schedule_help())
        p.define("jit_compile", False, "Compile each chunk's forward and backward with XLA, on the chunk's own "
                 "device (gpipe_tf/gpipe/xla_cells.py); the loop, the loss head and the optimizer stay in TensorFlow. "
                 "Same math, dropout masks included (docs/accelerators.md).")
        p.define("input_gradients", "auto", "Compute the gradient of the pipeline's input? 'auto': only if the "
                 "input is computed from variables (a data batch needs none); True when you watch the input "
                 "yourself (e.g. saliency maps).")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.num_micro_batches < 1:
            raise ParamsError(f"{self.path}.num_micro_batches={p.num_micro_batches} must be >= 1")
        schedule: Schedule = schedule_params(p.schedule, self.path).instantiate(self.path)
        # D data-parallel replicas (train.num_replicas; the trainer builds the task inside placement.replicas(D)):
        # replica r's stage k on device r*K+k, each with its own gradient sums.
        self.plan: StagePlan = make_plan(p, chunk_devices=schedule.step_order(max(1, p.num_stages)).devices_by_chunk,
                                         num_replicas=placement.num_replicas(), path=self.path)
        schedule.validate(self.plan, p.num_micro_batches, self.path)
        _check_jit_compile(p, self.path)
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
        schedule.allocate(self.plan, [tf.nest.flatten({n: self.children[n].theta for n in names})
                                      for names in self.stage_layers])
        object.__setattr__(self, "schedule", schedule)  # not tracked: see _TF_MODULE_IGNORED_PROPERTIES
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

    def _check_replica(self, index: int) -> None:
        if not 0 <= index < len(self.replica_devices):
            raise ParamsError(f"{self.path}: replica {index} does not exist; this pipeline was built with "
                              f"{len(self.replica_devices)} (train.num_replicas)")

    def partition_table(self) -> str:
        """The chosen split as text: stage, layers, params, remat, device, cost."""
        return partition.format_table(self.partition_rows, f"cost({self.plan.cost_kind or 'none'})")

    def cast_theta(self, theta: Mapping[str, Any]) -> dict[str, Any]:
        """`theta` unchanged: each stage casts its weights inside its own step (module doc, mixed precision)."""
        return dict(theta)

    def _run_stage(self, stage: int, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        out = inputs
        for name in self.stage_layers[stage]:
            child = self.children[name]
            out = child.fprop(child.cast_theta(theta[name]), out, ctx)
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
        traced = tf.function(lambda x: self._run_all(self.theta, x, ctx),
                             autograph=False).get_concrete_function(micro_batch_spec)
        return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), traced.structured_outputs)

    def fprop_in_sequence(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """The same layers in order on the caller's device: no stages, no micro-batches (export for serving).

        As in the pipelined forward, floating inputs are cast to `fprop_dtype` and each layer casts its own weights
        (`theta` as `fprop_theta` or `theta` gives it: `cast_theta` leaves a pipeline's weights to its stages).
        """
        if self.fprop_dtype != self.dtype:  # mixed precision: the first layer gets compute-dtype inputs (`_job`)
            inputs = self.to_fprop_dtype(inputs)
        return self._run_all(theta, inputs, ctx)

    def _run_all(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        for stage in range(self.plan.num_chunks):
            inputs = self._run_stage(stage, theta, inputs, ctx)
        return inputs

    def micro_batch_context(self, ctx: FPropContext, index: Any, collect_aux: bool) -> FPropContext:
        """The context of micro-batch `index`: the step's seed folded with the index, its own aux dict.

        index None: the whole batch's context (the step's seed itself), for a loss computed on the whole output.
        """
        if index is None:
            return FPropContext(training=ctx.training, seed=ctx.seed, aux={} if collect_aux else None)
        seed = None if ctx.seed is None else stateless_random.fold_in(ctx.seed, index)
        return FPropContext(training=ctx.training, seed=seed, aux={} if collect_aux else None)

    def _job(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tuple[PipelineJob, Any]:
        """The schedule's job for one mini-batch, and the inputs as the schedule gets them."""
        p = self.p
        if self.fprop_dtype != self.dtype:  # mixed precision: boundary activations travel in the compute dtype
            inputs = self.to_fprop_dtype(inputs)
        size = microbatch.check_divisible(inputs, p.num_micro_batches) // p.num_micro_batches
        replica = placement.current_replica()
        self._check_replica(replica)
        devices = self.replica_devices[replica]
        # Weights are read once per step on their stage's device and enter the schedule as tensors.
        stage_theta = []
        for stage, names in enumerate(self.stage_layers):
            with tf.device(devices[stage]):
                stage_theta.append({n: tf.nest.map_structure(tf.identity, theta[n]) for n in names})

        def run_chunk(chunk: int, weights: Sequence[tf.Tensor], x: Any, micro_ctx: FPropContext) -> Any:
            return self._run_stage(chunk, tf.nest.pack_sequence_as(stage_theta[chunk], list(weights)), x, micro_ctx)

        wanted = p.input_gradients
        compiled = (tuple(xla_cells.CompiledChunk(run_chunk, c, ctx.training) for c in range(self.plan.num_chunks))
                    if p.jit_compile else None)
        job = PipelineJob(
            plan=self.plan, num_micro_batches=p.num_micro_batches, replica=replica, devices=tuple(devices),
            chunk_scopes=tuple(self.replica_scopes[replica]),
            chunk_weights=tuple(tuple(tf.nest.flatten(t)) for t in stage_theta), run_chunk=run_chunk,
            micro_batch_context=lambda index, collect_aux: self.micro_batch_context(ctx, index, collect_aux),
            aux_spec=self.aux_stats_spec() if ctx.training and ctx.aux is not None else {},
            input_gradient=(depends_on_variables(float_leaves(inputs)) if wanted == "auto" else bool(wanted)),
            output_spec=self._output_structure(
                tf.nest.map_structure(lambda t: tf.TensorSpec([size] + t.shape[1:], t.dtype), inputs))
            if self.schedule.needs_output_spec else None,
            training=ctx.training, compiled_chunks=compiled)
        return job, inputs

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """Runs the pipeline on a mini-batch (any nested structure with a common leading batch dimension).

        The caller computes the loss from the outputs; schedules that need the loss inside the pipeline (1F1B)
        run fill-drain's loop here. Tasks use `fprop_with_loss`.
        """
        job, inputs = self._job(theta, inputs, ctx)
        outputs, aux = self.schedule.run(job, inputs)
        if aux is not None:
            ctx.aux.update(aux)
        return outputs

    def fprop_with_loss(self, theta: Mapping[str, Any], inputs: Any, loss: PipelineLoss,
                        ctx: FPropContext) -> dict[str, tf.Tensor]:
        """Runs the pipeline and `loss` (on the last chunk's device) on a mini-batch: {name: sum over the batch}.

        The "loss" sum is differentiable with respect to the inputs, the weights and `loss.head_weights`; see
        `PipelineLoss` for what `loss.fn` must return. Every schedule gives the same sums and gradients; the windowed
        schedules need this path for their order (the loss gradient of each micro-batch right after its forward), and
        FillDrain runs the loss per micro-batch through it, so that one micro-batch's logits exist at a time.
        """
        job, inputs = self._job(theta, inputs, ctx)
        devices = job.devices
        with tf.device(devices[-1]):
            head = tuple(tf.identity(w) for w in loss.head_weights)
        loss = dataclasses.replace(loss, head_weights=head)
        sums, aux = self.schedule.run_with_loss(job, inputs, loss)
        if aux is not None:
            ctx.aux.update(aux)
        return sums

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


def _check_jit_compile(p: InstantiableParams, path: str) -> None:
    """Raises ParamsError unless `jit_compile` is a bool."""
    if not isinstance(p.jit_compile, bool):
        raise ParamsError(f"{path}.jit_compile={p.jit_compile!r} must be True or False: True compiles each chunk's "
                          "forward and backward with XLA on its device, False (the default) runs TensorFlow's kernels")


def find_pipelines(p: Params, path: str = "task") -> list[tuple[str, InstantiableParams]]:
    """(path, Params) of every GPipe layer in a Params tree, `path` naming the tree's root (e.g. task.network).

    Each comes as a copy in which it and its layers state the dtype and fprop_dtype they will be built with, those
    they leave to their ancestors filled in (`base_layer.with_inherited_dtypes`): what a planner reads is what the
    pipeline will compute in (`--params=task.fprop_dtype=bfloat16` reaches every layer of task.network).
    """
    return _find_pipelines(p, path, "float32", "float32")


def _find_pipelines(p: Params, path: str, dtype: str, fprop_dtype: str) -> list[tuple[str, InstantiableParams]]:
    found = []
    if isinstance(p, InstantiableParams) and p.cls is GPipe:
        found.append((path, with_inherited_dtypes(p, dtype, fprop_dtype)))
    if "dtype" in p and "fprop_dtype" in p:  # a layer: what its children inherit
        dtype, fprop_dtype = inherited_dtypes(p, dtype, fprop_dtype)
    for name, value in p.items():
        for j, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, Params):
                found += _find_pipelines(item, f"{path}.{name}" + (f"[{j}]" if isinstance(value, (list, tuple))
                                                                    else ""), dtype, fprop_dtype)
    return found
