"""The contract between the GPipe layer and a schedule: what a schedule is given, what it returns, what it owns.

A schedule decides in which order, and as which ops, the K stages run on the M micro-batches of one mini-batch,
forward and backward. It is configured by Params (``GPipe.params().schedule = FillDrain.params()``), owns its
knobs and its state, and is given plain data only (`PipelineJob`): the stage plan, one callable per stage, the
stages' weights as tensors, the stage devices and scopes. It never reaches into the GPipe layer.

A schedule must give the loss and gradients of the layers run in sequence (the tests check every schedule
against the un-pipelined model) and keep each stage's work, stashes and weight-gradient sums on the stage's
device, so that only stage-boundary activations and their gradients cross devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from gpipe_tf.gpipe.plan import StagePlan
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.layers.base_layer import FPropContext

# run_stage(stage, weights, inputs, ctx) -> outputs: stage `stage`'s layers on one micro-batch.
RunStage = Callable[[int, Sequence[tf.Tensor], Any, FPropContext], Any]
# micro_batch_context(index, collect_aux) -> the FPropContext of micro-batch `index` (its own seed and aux dict).
MicroBatchContext = Callable[[Any, bool], FPropContext]


@dataclasses.dataclass(frozen=True)
class PipelineJob:
    """One mini-batch's work for a schedule, as plain data.

    Attributes:
      plan: the stage plan (balance, per-stage remat decision, devices of every replica).
      num_micro_batches: M; the batch dimension of every input leaf is divisible by it.
      replica: which data-parallel replica runs this job (its devices are `devices`).
      devices: this replica's stage devices, one per stage.
      stage_scopes: this replica's stage scopes (`placement.on_stage`), one per stage.
      stage_weights: each stage's weights as a flat list of tensors, read on the stage's device.
      run_stage: runs one stage's layers given its flat weights; see `RunStage`.
      micro_batch_context: the context of micro-batch i; see `MicroBatchContext`.
      aux_spec: the auxiliary statistics (e.g. batch-norm moments) to sum over micro-batches, as
        {path: TensorSpec}; empty when none are collected.
      input_gradient: whether the pipeline's input needs a gradient.
      output_spec: the TensorSpecs of one micro-batch's output, for schedules that set `needs_output_spec`
        (it may cost a trace of the stages); else None.
    """

    plan: StagePlan
    num_micro_batches: int
    replica: int
    devices: tuple[str, ...]
    stage_scopes: tuple[Any, ...]
    stage_weights: tuple[tuple[tf.Tensor, ...], ...]
    run_stage: RunStage
    micro_batch_context: MicroBatchContext
    aux_spec: dict[str, Any]
    input_gradient: bool
    output_spec: Any

    @property
    def num_stages(self) -> int:
        """K."""
        return len(self.devices)


class Schedule:
    """Base class of pipeline schedules: Params-configured, owning their state, run on a `PipelineJob`."""

    # Whether `run` reads `PipelineJob.output_spec`.
    needs_output_spec = False

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params; subclasses define their knobs."""
        return InstantiableParams(cls)

    def __init__(self, params: InstantiableParams, path: str = "") -> None:
        self.p = params.copy().freeze()
        self.path = path

    def allocate(self, plan: StagePlan, stage_variables: Sequence[Sequence[tf.Variable]]) -> None:
        """Creates the schedule's state once, when the GPipe layer is built (default: none).

        stage_variables: each stage's trainable variables, flat, in the order of `PipelineJob.stage_weights`.
        """

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """Runs the pipeline on a mini-batch: (outputs, summed aux statistics or None when none are collected).

        The outputs are the micro-batch outputs concatenated along the batch dimension; their gradients, when
        the caller's tape asks, are those of the layers run in sequence.
        """
        raise NotImplementedError
