"""The contract between the GPipe layer and a schedule: what a schedule is given, what it returns, what it owns.

A schedule decides in which order, and as which ops, the K stages run on the M micro-batches of one mini-batch,
forward and backward. It is configured by Params (``GPipe.params().schedule = FillDrain.params()``), owns its
knobs and its state, and is given plain data only (`PipelineJob`): the stage plan, one callable per chunk (a stage,
unless the schedule runs v chunks per device; `orders.py` defines the words), the chunks' weights as tensors, their
devices and scopes. It never reaches into the GPipe layer.

A schedule must give the loss and gradients of the layers run in sequence (the tests check every schedule
against the un-pipelined model) and keep each stage's work, stashes and weight-gradient sums on the stage's
device, so that only stage-boundary activations and their gradients cross devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.plan import StagePlan
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import FPropContext

# run_chunk(chunk, weights, inputs, ctx) -> outputs: chunk `chunk`'s layers on one micro-batch.
RunChunk = Callable[[int, Sequence[tf.Tensor], Any, FPropContext], Any]
# micro_batch_context(index, collect_aux) -> the FPropContext of micro-batch `index` (its own seed and aux dict).
MicroBatchContext = Callable[[Any, bool], FPropContext]
# loss_fn(head_weights, outputs, targets, ctx) -> {name: scalar sum over the examples of `outputs`}; "loss" is
# differentiated, the other entries (metric numerators) are not.
LossFn = Callable[[Sequence[tf.Tensor], Any, Any, FPropContext], dict]


@dataclasses.dataclass(frozen=True)
class PipelineLoss:
    """The loss a task hands the pipeline, for its last chunk's device to compute per micro-batch.

    `fn` returns sums over the examples it is given (never means), so that the sums of its values over the M
    micro-batches equal its values on the whole batch, exactly as the task's full-batch loss; the task divides by
    its normalizer (e.g. the summed label weights, computed from the targets before the pipeline). Padding and
    label weights enter through `targets`, so they combine as in the full-batch loss.

    Attributes:
      fn: see `LossFn`. It runs on the last chunk's device (`PipelineJob.devices[-1]`), inside the schedule.
      head_weights: the flat weights `fn` uses (e.g. the softmax layer's), whose gradients the pipeline returns.
      targets: any nested tensors with the batch dimension first (labels, weights), split into micro-batches like
        the inputs.
      gradient_seed: the gradient of the task's loss with respect to the "loss" sum (a float32 scalar: the loss
        scale over the normalizer), for schedules that compute each micro-batch's loss gradient in their loop
        (1F1B; FillDrain's output gradients): it starts from it, so that loss scaling protects half-precision
        gradients there as it does in a tape's backward. The gradients returned are rescaled to the caller's true
        upstream gradient. None: 1.0.
    """

    fn: LossFn
    head_weights: tuple[tf.Tensor, ...]
    targets: Any
    gradient_seed: Any = None


@dataclasses.dataclass(frozen=True)
class PipelineJob:
    """One mini-batch's work for a schedule, as plain data.

    Attributes:
      plan: the stage plan (balance, per-stage remat decision, devices of every replica).
      num_micro_batches: M; the batch dimension of every input leaf is divisible by it.
      replica: which data-parallel replica runs this job (its devices are `devices`).
      devices: this replica's devices, one per chunk.
      chunk_scopes: this replica's scopes (`placement.on_stage`), one per chunk.
      chunk_weights: each chunk's weights as a flat list of tensors, read on the chunk's device.
      run_chunk: runs one chunk's layers given its flat weights; see `RunChunk`.
      micro_batch_context: the context of micro-batch i; see `MicroBatchContext`.
      aux_spec: the auxiliary statistics (e.g. batch-norm moments) to sum over micro-batches, as
        {path: TensorSpec}; empty when none are collected.
      input_gradient: whether the pipeline's input needs a gradient.
      output_spec: the TensorSpecs of one micro-batch's output, for schedules that set `needs_output_spec`
        (it may cost a trace of the stages); else None.
      training: whether this is a training step (gradients will be taken); schedules that compute gradients in
        their forward pass (1F1B) do so only then.
      compiled_chunks: with `jit_compile`, each chunk's XLA cells (`xla_cells.CompiledChunk`), which
        `loop_parts.chunk_fn` runs instead of `run_chunk`; None: TensorFlow's kernels.
    """

    plan: StagePlan
    num_micro_batches: int
    replica: int
    devices: tuple[str, ...]
    chunk_scopes: tuple[Any, ...]
    chunk_weights: tuple[tuple[tf.Tensor, ...], ...]
    run_chunk: RunChunk
    micro_batch_context: MicroBatchContext
    aux_spec: dict[str, Any]
    input_gradient: bool
    output_spec: Any
    training: bool = False
    compiled_chunks: tuple[Any, ...] | None = None

    @property
    def num_chunks(self) -> int:
        """The chunks the loop runs: K, or v x K for the schedules with v chunks per device (`StagePlan.num_chunks`)."""
        return len(self.devices)


# Short names a `schedule` field may hold instead of Params: {name: class}, filled by each subclass that gives one
# (`class FillDrain(Schedule, short_name="fill_drain")`), so that this module imports no schedule.
_SHORT_NAMES: dict[str, type] = {}


class Schedule:
    """Base class of pipeline schedules: Params-configured, owning their state, run on a `PipelineJob`.

    A subclass may give a short name, `class FillDrain(Schedule, short_name="fill_drain")`, which then stands for
    its default Params wherever a `schedule` field is set (`named_params`).
    """

    # Whether `run` reads `PipelineJob.output_spec`.
    needs_output_spec = False

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params; subclasses define their knobs."""
        return InstantiableParams(cls)

    def __init_subclass__(cls, short_name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if short_name is not None:
            if short_name in _SHORT_NAMES and _SHORT_NAMES[short_name] is not cls:
                raise ValueError(f"schedule short name {short_name!r} is taken by {_SHORT_NAMES[short_name]}; "
                                 f"give {cls.__name__} another")
            _SHORT_NAMES[short_name] = cls

    @classmethod
    def short_names(cls) -> dict[str, type[Schedule]]:
        """{short name: schedule class} of every schedule imported so far (`schedules.py` imports them all), in the
        names' alphabetical order."""
        return dict(sorted(_SHORT_NAMES.items()))

    @classmethod
    def named_params(cls, name: str) -> InstantiableParams:
        """The default Params of the schedule a short name stands for (`short_names`): what an override such as
        `task.network.schedule=interleaved` sets."""
        if name not in _SHORT_NAMES:
            raise ParamsError(f"unknown schedule name {name!r}: use one of {', '.join(cls.short_names())}, or a "
                              "schedule class path, e.g. gpipe_tf.gpipe.interleaved.Interleaved")
        return _SHORT_NAMES[name].params()

    def __init__(self, params: InstantiableParams, path: str = "") -> None:
        self.p = params.copy().freeze()
        self.path = path

    def step_order(self, num_devices: int) -> ScheduleOrder:
        """This schedule's order of one step's cells on `num_devices` devices, as data (`orders.ScheduleOrder`):
        stated once here, and read by its loop, `timeline.predict`, the measured-timeline reader and the
        benchmark's bound. Its `devices_by_chunk` are the devices of the chunks the stage plan makes."""
        raise NotImplementedError

    def validate(self, plan: StagePlan, num_micro_batches: int, path: str = "") -> None:
        """Raises ParamsError where this schedule cannot run `plan` with `num_micro_batches` (default: where M
        is not a multiple of its order's `micro_batch_multiple`)."""
        self.step_order(plan.num_devices).check_micro_batches(num_micro_batches, path)

    def allocate(self, plan: StagePlan, stage_variables: Sequence[Sequence[tf.Variable]]) -> None:
        """Creates the schedule's state once, when the GPipe layer is built (default: none).

        stage_variables: each chunk's trainable variables, flat, in the order of `PipelineJob.chunk_weights`.
        """

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """Runs the pipeline on a mini-batch: (outputs, summed aux statistics or None when none are collected).

        The outputs are the micro-batch outputs concatenated along the batch dimension; their gradients, when
        the caller's tape asks, are those of the layers run in sequence.
        """
        raise NotImplementedError

    def run_with_loss(self, job: PipelineJob, inputs: Any, loss: PipelineLoss) -> tuple[dict, dict[str, Any] | None]:
        """Runs the pipeline and the task's loss on a mini-batch: ({name: sum over the batch}, aux statistics).

        The "loss" sum is differentiable with respect to the inputs, the stages' weights and `loss.head_weights`.
        This default runs `run` and then `loss.fn` once on the whole output, on the last chunk's device: since
        `fn` returns sums, that equals the sum over micro-batches. FillDrain (one micro-batch's head at a time)
        and the schedules that need each micro-batch's loss gradient before the next micro-batch's forward pass
        (1F1B) override it.
        """
        outputs, aux = self.run(job, inputs)
        with tf.device(job.devices[-1]):
            sums = loss.fn(loss.head_weights, outputs, loss.targets, job.micro_batch_context(None, False))
        return dict(sums), aux
