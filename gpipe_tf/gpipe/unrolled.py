"""The unrolled schedule: every (stage, micro-batch) step placed explicitly, backward in GPipe's order.

The whole pipeline is one `tf.custom_gradient` op. Its forward runs F(k, i) for every micro-batch i and stage k
under stage k's device and name scope. A stage without rematerialization records its forward on a tape of its own
(the activations stay alive until its backward); a rematerialized stage keeps only its input. The backward,
called by the task's ordinary `tape.gradient` with the gradient of the loss with respect to the pipeline's output,
runs B(k, i) for micro-batches M-1 .. 0 and stages K-1 .. 0, each on its stage's device: it recomputes the stage's
forward if needed, takes the gradient of that one stage, adds the weight gradient in place into the stage's
gradient sums (variables allocated once, next to the weights) and hands the input gradient to stage k-1. A control
dependency makes B(k, i) wait for B(k, i+1)'s additions, so a stage holds one partial weight gradient at a time
and works in GPipe's order; nothing of the backward can start before the last forward ends, since the loss
gradient needs the whole output.

Every op is placed on its stage's device, weight gradients are summed on that device, and the only transfers are
stage-boundary activations and their gradients, which makes this the schedule to use across processes, hosts and
GPUs. Its graph is unrolled over M (about twice the ops of one step per micro-batch and stage); the
fill_drain schedule (`fill_drain.py`) keeps the graph constant in M instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import loop_parts, microbatch, orders, placement
from gpipe_tf.gpipe.leaves import is_float, with_float_leaves
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.plan import StagePlan
from gpipe_tf.gpipe.remat import StageForward
from gpipe_tf.gpipe.schedule_base import PipelineJob, Schedule


class Unrolled(Schedule, short_name="unrolled"):
    """GPipe's fill-drain order with every (stage, micro-batch) step its own op group; the graph grows with M.

    State: one gradient sum per weight, stage and replica, a variable on the stage's device, allocated once.
    """

    def __init__(self, params: Any, path: str = "") -> None:
        super().__init__(params, path)
        self.gradient_sums: list[list[list[tf.Variable]]] = []  # [replica][stage][weight]

    def step_order(self, num_devices: int) -> ScheduleOrder:
        """GPipe's order, as `FillDrain`'s (every forward, then the backwards from the last micro-batch to the
        first), under its own name, with the loss on the whole output."""
        return dataclasses.replace(orders.fill_drain(num_devices), name="unrolled")

    def allocate(self, plan: StagePlan, stage_variables: Sequence[Sequence[tf.Variable]]) -> None:
        """One gradient sum per weight next to it, for every replica's devices."""
        for r, devices in enumerate(plan.devices or ()):
            sums = []
            for stage, variables in enumerate(stage_variables):
                with tf.device(devices[stage]):
                    sums.append([tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                             name=f"{self.path}/gradient_sum_{r}_{stage}_{j}")
                                 for j, v in enumerate(variables)])
            self.gradient_sums.append(sums)

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """Runs the job as an unrolled, explicitly placed schedule; see the module doc."""
        arguments = loop_parts.OpArguments.of(job, inputs)
        output: dict[str, Any] = {}

        @tf.custom_gradient
        def pipeline(*args: tf.Tensor) -> Any:
            split = arguments.split(args)
            records, outs, output["aux"] = _forward(job, with_float_leaves(inputs, split.inputs), split.chunk_weights)
            output["structure"] = outs[0]
            with tf.device(job.devices[-1]):
                flat_outs = [tf.concat(parts, axis=0) for parts in zip(*[tf.nest.flatten(o) for o in outs])]
            sums = self.gradient_sums[job.replica]
            return flat_outs, lambda *upstream: _backward(job, records, sums, outs[0], split.inputs, upstream)

        flat_out = pipeline(*arguments.flat)
        return tf.nest.pack_sequence_as(output["structure"], list(flat_out)), output["aux"]


def _forward(job: PipelineJob, inputs: Any, weights: Sequence[Sequence[tf.Tensor]]
             ) -> tuple[list[list[StageForward]], list[Any], dict[str, Any] | None]:
    """F(c, i) for every micro-batch i and chunk c, each under its chunk's device: (records[c][i], each
    micro-batch's output, the summed aux statistics or None when none are collected)."""
    num_chunks, m = job.num_chunks, job.num_micro_batches
    with tf.device(job.devices[0]):
        micro = microbatch.split_list(inputs, m)
    records: list[list[StageForward]] = [[] for _ in range(num_chunks)]
    outs, aux_parts = [], []
    for i in range(m):
        ctx = job.micro_batch_context(i, bool(job.aux_spec))
        h = micro[i]
        for c in range(num_chunks):
            with placement.on_stage(job.chunk_scopes[c]):
                records[c].append(StageForward(loop_parts.chunk_fn(job, c, ctx), weights[c], h,
                                               c > 0 or job.input_gradient, job.plan.remat[c]))
                h = records[c][i].outputs
        outs.append(h)
        if job.aux_spec:
            aux_parts.append(ctx.aux)
    if not job.aux_spec:
        return records, outs, None
    with tf.device(job.devices[-1]):
        aux = {path: tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *[part[path] for part in aux_parts])
               for path in job.aux_spec}
    return records, outs, aux


def _backward(job: PipelineJob, records: list[list[StageForward]], gradient_sums: list[list[tf.Variable]],
              structure: Any, xs: list[tf.Tensor], upstream: Sequence[tf.Tensor]) -> list[Any]:
    """B(c, i) for micro-batches M-1 .. 0 and chunks K-1 .. 0, each adding its weight gradients into the chunk's
    sums in place: the op's gradients (in `OpArguments.flat` order)."""
    num_chunks, m = job.num_chunks, job.num_micro_batches
    out_is_float = [is_float(t) for t in tf.nest.flatten(structure)]
    with tf.device(job.devices[-1]):
        float_upstream = [tf.split(g, m, axis=0) for g, f in zip(upstream, out_is_float) if f]
    updates: list[list[Any] | None] = [None] * num_chunks  # updates[c]: the last in-place additions into chunk c's sums
    input_grads = []
    for i in reversed(range(m)):
        dy = [parts[i] for parts in float_upstream]
        for c in reversed(range(num_chunks)):
            with placement.on_stage(job.chunk_scopes[c]):
                # B(c, i) after B(c, i+1): one partial weight gradient per chunk at a time.
                dx, weight_grads = records[c][i].gradient(dy, after=updates[c] or [])
                add = "assign" if updates[c] is None else "assign_add"  # the first needs no zeroing
                updates[c] = [getattr(acc, add)(g, read_value=False) for acc, g in zip(gradient_sums[c], weight_grads)]
                dy = dx
        input_grads.append(dy)
    with tf.device(job.devices[0]):
        if job.input_gradient:
            dx = [tf.concat(parts[::-1], axis=0) for parts in zip(*input_grads)]
        else:
            dx = [tf.zeros_like(t) for t in xs]
    sums = []
    for c in range(num_chunks):
        with tf.device(job.devices[c]), tf.control_dependencies(updates[c]):
            sums += [acc.read_value() for acc in gradient_sums[c]]
    return dx + sums
