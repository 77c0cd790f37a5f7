"""The memory of one pipeline stage (one chunk of layers on one device) from Params alone.

What a stage holds at its peak, the start of the backward pass of its last stashed micro-batch:

* weights, their gradient sums and the optimizer's slots (and an EMA copy), in the variables' dtype;
* stashes: for every stashed micro-batch its input copy (kept under every remat policy) and, without remat, every
  activation its layers keep for the backward pass (`BaseLayer.activation_bytes`, at the compute dtype); in mixed
  precision also the compute-dtype copies of the weights, which each micro-batch casts anew (`weight_casts`);
* with remat, one micro-batch's activations recomputed for its backward pass;
* boundary buffers: the input the stage received (the whole mini-batch on the first stage) and the output it
  sent, with their gradients (the last fill-drain stage keeps every micro-batch's output gradient, the last
  unrolled stage every micro-batch's output and its gradient; a stage that holds the whole mini-batch and computes
  its input's gradient holds all of it);
* working memory of the backward pass: one layer's weight gradients before they are added to the sums, the
  activation gradient flowing between layers, the largest scratch buffer of one kernel (a convolution's gradient
  on a CPU: `BaseLayer.scratch_bytes`), the optimizer's temporaries that read only variables (computed as
  soon as the step starts) and, with remat, the copy of the weights the recomputation differentiates;
* or, if larger, the optimizer update's temporaries (`plan.optimizer_memory`);
* on the last chunk's device, the task's loss head too (`head.py`): its weights, gradient sums and optimizer slots
  with the stage's, and its logits and loss tensors for the micro-batches it runs on at once, alive with the stashes
  and, where the loss runs beside the backward passes (the windowed schedules), with the backward's working memory;
  fill-drain runs it in the forward loop, ended before its backward loop starts, so there the peak is the head's
  phase or the backward's, whichever is larger (unrolled's head weight gradient may run beside the backward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.layers.base_layer import spec_bytes
from gpipe_tf.layers.estimates import estimate


@dataclasses.dataclass(frozen=True)
class OptimizerMemory:
    """An optimizer's memory in copies of the weights: its slots, the weight-sized temporaries of its update that
    read only variables (a graph step computes them at once, so they are alive through the whole backward pass),
    and all the weight-sized temporaries its update holds at once (none that could reuse a gradient's buffer)."""

    slots: float
    early: float
    update: float


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds, by kind; `peak` is their sum at the start of the backward pass."""

    params: int
    weights: int
    gradient_sums: int
    optimizer_slots: int
    ema: int
    stashed_activations: int
    recompute: int
    boundary_buffers: int
    backward_working: int
    optimizer_update: int
    stashed_micro_batches: int
    loss_head: int = 0  # the loss head's logits and loss tensors (the last chunk's stage; its weights are counted)
    # Where the loss head runs before any backward (fill-drain's forward loop): what that phase holds besides the
    # stashes and the optimizer's early temporaries (the head's tensors, the activation flowing); 0 where the head
    # runs beside the backward passes (the windowed schedules) or there is no head.
    forward_working: int = 0
    # The optimizer's temporaries that read only variables: computed as the step starts, alive through every
    # phase until the update (part of `backward_working` in the table's column).
    optimizer_early: int = 0

    @property
    def persistent(self) -> int:
        """What the stage holds through the whole step: weights, gradient sums, slots, EMA, boundary buffers."""
        return self.weights + self.gradient_sums + self.optimizer_slots + self.ema + self.boundary_buffers

    @property
    def working(self) -> int:
        """What the stage's own backward pass (or, where the loss head runs before any backward, its forward phase
        with the head) adds while it runs: one chunk of a device at a time runs it."""
        head_in_backward = 0 if self.forward_working else self.loss_head
        return max(self.recompute + self.backward_working - self.optimizer_early + head_in_backward,
                   self.forward_working)

    @property
    def peak(self) -> int:
        """Predicted peak bytes: what persists, plus the largest of the backward pass's, the update's and, where the
        loss head runs before any backward (`forward_working`), the forward phase's needs. Elsewhere the loss
        head's tensors count as alive with the stage's backward working memory: its weight gradient's matmul still
        reads the logits' gradient when the stage's backward may start."""
        return device_peak([self])

    def as_dict(self) -> dict[str, int]:
        """The fields and the peak, for JSON."""
        return {**dataclasses.asdict(self), "peak": self.peak}


@dataclasses.dataclass(frozen=True)
class LayerTrace:
    """Per layer of a stage, from Params: parameters, activation bytes of one micro-batch, output spec."""

    params: int
    activation_bytes: int
    output_spec: Any
    shared_with_previous: int = 0  # bytes of activation_bytes the previous layer of the stage already keeps
    scratch: int = 0  # the largest scratch buffer of one op of its backward pass (`BaseLayer.scratch_bytes`)


def trace_layers(layers: Sequence[InstantiableParams], input_spec: Any, names: Sequence[str]) -> list[LayerTrace]:
    """Each layer's parameters and activations on its input spec, propagating specs; a layer that cannot say
    raises ConfigError naming it and what is missing."""
    out = []
    spec = input_spec
    for name, lp in zip(names, layers):
        what = "num_params"
        try:
            count = int(estimate(lp, "num_params"))
            what = "output_spec"
            next_spec = estimate(lp, "output_spec", spec)
            what = "activation_bytes"
            kept = int(estimate(lp, "activation_bytes", spec))
            shared = getattr(lp.cls, "shared_with_previous_bytes", None)
            shared = int(shared(lp, spec)) if shared is not None else 0
            scratch = int(estimate(lp, "scratch_bytes", spec))
        except NotImplementedError as e:
            raise ConfigError(f"memory plan: {name} ({lp.cls.__name__}) cannot estimate its memory from Params: "
                              f"{lp.cls.__name__}.{what} is missing ({e}); implement it, or plan without "
                              "--device_memory") from None
        out.append(LayerTrace(count, kept, next_spec, shared, scratch))
        spec = next_spec
    return out


@dataclasses.dataclass(frozen=True)
class StageSetting:
    """How a stage runs: what the planner needs besides its layers."""

    micro_batches: int  # M of the pipeline
    stashed: int  # micro-batches held stashed at the peak (from the schedule)
    remat: bool
    first: bool  # the stage holds the whole mini-batch input
    last: bool
    # Output-sized tensors the stage holds at its peak: 2 (one output and its gradient); on the last stage M + 1
    # where the loss runs in the forward loop but the backward waits for every forward (fill-drain: every
    # micro-batch's output gradient, and one output), 2M where the loss runs on all M outputs at once (unrolled).
    kept_outputs: int = 2
    input_gradient: bool = True  # the stage sends its input's gradient back (every stage but a data-fed first)
    variable_bytes: int = 4  # bytes per variable element (float32)
    compute_bytes: int = 4  # bytes per element of the compute dtype
    optimizer: OptimizerMemory = OptimizerMemory(0.0, 0.0, 0.0)
    ema: bool = False
    head_params: tuple[int, ...] = ()  # the loss head's layers' parameter counts, on this stage's device
    head_bytes: int = 0  # the loss head's logits and loss tensors at once (`head.head_memory`)
    head_before_backward: bool = False  # the head ends before any stage's backward (fill-drain's forward loop)
    # Micro-batches whose mixed-precision cast of the weights is held at the peak without remat (None: `stashed`):
    # a windowed loop casts for every micro-batch as it starts (a cast reads only the weights, so no window holds
    # it back), one graph without a loop casts once (TensorFlow merges the M identical casts).
    weight_casts: int | None = None


def stage_memory(traces: Sequence[LayerTrace], input_spec: Any, setting: StageSetting) -> StageMemory:
    """The stage's memory under `setting`; see the module doc."""
    stage_params = sum(t.params for t in traces)
    params = stage_params + sum(setting.head_params)
    weights = params * setting.variable_bytes
    # A layer's count may include a tensor the previous layer of the stage keeps too (an AmoebaNet cell's ReLU of
    # h[i-2], the previous cell's ReLU of its h[i-1]): the stage keeps it once.
    activations = sum(t.activation_bytes for t in traces) - sum(t.shared_with_previous for t in traces[1:])
    in_bytes = spec_bytes(input_spec)
    out_bytes = spec_bytes(traces[-1].output_spec) if traces else in_bytes
    # Mixed precision: each micro-batch casts the stage's weights; without remat the backward keeps the cast.
    cast_weights = stage_params * setting.compute_bytes if setting.compute_bytes != setting.variable_bytes else 0
    # The stage's input copy is what it received: on the first stage a slice of the mini-batch it holds (a slice
    # along the batch shares its buffer), on a later stage the transferred micro-batch itself.
    per_micro_batch = (0 if setting.first else in_bytes) + (0 if setting.remat else activations)
    casts = setting.stashed if setting.weight_casts is None else setting.weight_casts
    stash = setting.stashed * per_micro_batch + (0 if setting.remat else casts * cast_weights)
    recompute = activations + cast_weights if setting.remat else 0
    received = setting.micro_batches * in_bytes if setting.first else 0
    sent = setting.kept_outputs * out_bytes
    returned = 0 if not setting.input_gradient else (setting.micro_batches * in_bytes if setting.first else in_bytes)
    boundary = received + sent + returned
    # The backward pass computes one layer's weight gradients at a time and adds them to the sums; one activation
    # gradient flows between layers (each layer's stashed activations are freed as its gradient uses them); the
    # optimizer's temporaries that read only variables are alive throughout; a recomputing stage differentiates
    # with respect to a copy of its weights made in the backward pass (`gpipe/remat.py` says why).
    largest_layer = max([t.params for t in traces] + list(setting.head_params) + [0]) * setting.variable_bytes
    flowing = max(in_bytes, out_bytes)
    opt = setting.optimizer
    scratch = max([t.scratch for t in traces] + [0])  # ops run one at a time: one kernel's scratch at once
    early = int(opt.early * weights)
    backward_working = largest_layer + flowing + scratch + early + (weights if setting.remat else 0)
    apart = setting.head_before_backward and setting.head_bytes > 0
    forward_working = setting.head_bytes + flowing if apart else 0
    return StageMemory(params=params, weights=weights, gradient_sums=weights,
                       optimizer_slots=int(opt.slots * weights), ema=weights if setting.ema else 0,
                       stashed_activations=stash, recompute=recompute, boundary_buffers=boundary,
                       backward_working=backward_working, optimizer_update=int(opt.update * weights),
                       stashed_micro_batches=setting.stashed, loss_head=setting.head_bytes,
                       forward_working=forward_working, optimizer_early=early)


def device_peak(chunks: Sequence[StageMemory]) -> int:
    """The predicted peak of a device that holds `chunks` (an interleaved or V device holds several): every chunk's
    persistent memory, stashes and optimizer temporaries that read only variables, plus the largest one chunk's
    backward (or head) phase adds (a device runs one op at a time: one chunk's backward, recompute and kernel
    scratch at once), or, if larger, the optimizer update's temporaries of all of them."""
    persistent = sum(c.persistent for c in chunks)
    held = sum(c.stashed_activations + c.optimizer_early for c in chunks)
    update = sum(c.optimizer_update for c in chunks)
    return persistent + max(held + max(c.working for c in chunks), update)


def compute_spec(spec: Any, dtype: str) -> Any:
    """`spec` with floating leaves in the compute dtype (the pipeline casts its floating inputs to it)."""
    def cast(s: tf.TensorSpec) -> tf.TensorSpec:
        return tf.TensorSpec(s.shape, dtype) if tf.as_dtype(s.dtype).is_floating else s
    return tf.nest.map_structure(cast, spec)
