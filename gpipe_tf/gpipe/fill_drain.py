"""The fill-drain schedule as one while loop: a graph constant in M, every chunk's state on its own device.

Forward: one `tf.while_loop` over micro-batches; its body runs chunk 0, 1, ..., S-1 on micro-batch i (the K stages,
or the v x K chunks of a schedule whose forward pass this loop runs; `orders.py` defines the words), each under its
chunk's device and name scope. Each device runs its part of the loop on its own, so chunk 0 starts micro-batch i+1
while chunk 1 runs micro-batch i, which gives GPipe's fill (`parallel_iterations`, default 1, is per device).
Backward: TensorFlow's gradient of that loop, a second loop that starts once the whole output gradient exists
(all forwards, then all backwards, micro-batches in reverse), so the graph does not grow with M.

Where things live, and why (checked on the placed graph, `tests/pipeline/test_pipeline.py`):

* A lowered while loop places each loop variable's nodes with its initial value, and runs its condition (and
  any unplaced body node) on the While op's device (`placement.loop_device`). Every op here is built under its
  chunk's device; the loop counters start on the chunk that uses them (the first chunk reads micro-batches and
  makes each one's seed with its own; the last chunk writes outputs with its own), so what the backward keeps of
  an index stays there too.
* The While ops themselves (forward and backward) sit on this process's CPU (`placement.host_device()`), which
  runs no chunk, and the forward loop's condition is its own iteration count (`maximum_iterations`), kept
  there too: the next micro-batch never waits for a chunk's answer. A single-thread worker handles a message
  only when its current chain of ops ends, so a condition that needed a busy device (the last chunk's counter)
  would hold the first chunk's next forward until the last chunk finished the current one, and the forward would
  run the chunks in turn. The backward loop's counter and condition sit on the host too
  (`placement.colocate_gradients`) for the same reason: on the last chunk's device the backward would wait for it.
* Each chunk's weights are loop variables passed through unchanged, so TensorFlow's backward loop sums their
  gradients in loop variables that start from zeros made here on the chunk's device. (In-place additions into
  variables would be stateful ops, and a lowered loop starts its next iteration only after all of the
  previous iteration's stateful ops: the backward would not overlap chunks at all.)
* Each chunk runs as one op (`stage_op`) whose gradient runs on the chunk's device; each chunk first copies its
  input there, so the stashes TensorFlow keeps for the backward (chunk inputs; with remat off also activations)
  are pushed on that device. Only boundary activations, their gradients and the loop control cross devices.
* Rematerialization is the same op recomputing its forward pass in its gradient, once the boundary gradient
  has arrived (`remat.stage_op`; `remat.py` says why not `tf.recompute_grad`).
* Given the task's loss (`run_with_loss`, how tasks run it), the last chunk computes each micro-batch's loss in the
  forward loop, right after its forward, and, when training, the gradient of its output and of the head's
  weights (seeded with `PipelineLoss.gradient_seed`, as the windowed loop does): one micro-batch's logits exist
  at a time, as in GPipe, where the whole mini-batch's would fill the last device. The loss is one op whose
  gradient in the backward loop is that output gradient, rescaled to the caller's; the head's weight gradients
  are summed in loop variables. Only the output gradients wait for the backward (one output's size per
  micro-batch, where the loop without a loss keeps the outputs).
* With `batch_weight_gradients`, the matmul weights' gradients are not summed in the backward loop: each matmul's
  input and output gradient leave the loop as the gradients of TensorLists the forward reads placeholders from,
  and after it each weight's gradient is one matmul on its chunk's device (`batched_weights.RoutedStashes`). With
  "auto" (the default), only the weights `batched_weights.auto_selection` picks; none under XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from gpipe_tf.gpipe import batched_weights, loop_parts, microbatch, orders, placement
from gpipe_tf.gpipe.leaves import float_leaves, is_float, with_float_leaves
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.remat import stage_op
from gpipe_tf.gpipe.schedule_base import PipelineJob, PipelineLoss, Schedule
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import FPropContext


class FillDrain(Schedule, short_name="fill_drain"):
    """GPipe's fill-drain order as one placed while loop and its gradient: a graph constant in M (the default)."""

    needs_output_spec = True  # the loop writes each micro-batch's output into preallocated TensorArrays

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: parallel_iterations, batch_weight_gradients."""
        p = super().params()
        p.define("parallel_iterations", 1, "Loop iterations (micro-batches) each device runs at once. 1 (default): a "
                 "stage works on one micro-batch at a time while the other stages work on theirs; higher values "
                 "run no faster on single-thread workers and keep more micro-batches' stashes alive.")
        return batched_weights.define_knob(p)

    def __init__(self, params: InstantiableParams, path: str = "") -> None:
        super().__init__(params, path)
        value = self.p.parallel_iterations
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ParamsError(f"{path}.schedule.parallel_iterations={value!r} must be a whole number >= 1; use 1 "
                              "(the default)")
        batched_weights.check_knob(self.p, path)

    def step_order(self, num_devices: int) -> ScheduleOrder:
        """GPipe's order: every forward, then the backwards from the last micro-batch to the first (with the
        weight gradients batched after each stage's last backward if `batch_weight_gradients`)."""
        order = dataclasses.replace(orders.fill_drain(num_devices), head_in_forward=True)
        return batched_weights.apply_knob(order, self.p)

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """Runs the job's micro-batches in one placed while loop; see the module doc."""
        return run_loop(job, inputs, self.p.parallel_iterations,
                        self.p.batch_weight_gradients if job.training else False)

    def run_with_loss(self, job: PipelineJob, inputs: Any, loss: PipelineLoss) -> tuple[dict, dict[str, Any] | None]:
        """The loop with each micro-batch's loss on the last chunk, right after its forward; see the module doc."""
        return run_loop(job, inputs, self.p.parallel_iterations,
                        self.p.batch_weight_gradients if job.training else False, loss)


def run_loop(job: PipelineJob, inputs: Any, parallel_iterations: int = 1, batch_weight_gradients: bool | str = False,
             loss: PipelineLoss | None = None) -> tuple[Any, dict[str, Any] | None]:
    """The fill-drain loop of the module doc on `job`: (outputs, or with `loss` {name: sum over the batch}; summed
    aux statistics or None). Also the forward pass of the schedules that run their backward inside the forward
    (1F1B) when no gradient is taken.

    parallel_iterations: loop iterations (micro-batches) each device runs at once.
    batch_weight_gradients: route the watched matmuls' inputs and output gradients out of the backward loop and
      compute each weight's gradient once after it (`batched_weights.RoutedStashes`); "auto": only for the weights
      `batched_weights.auto_selection` picks.
    loss: the task's loss, run per micro-batch on the last chunk (its "loss" sum is differentiable as
      `Schedule.run_with_loss` says); None: the outputs are returned.
    """
    return FillDrainLoop(job, inputs, parallel_iterations, batch_weight_gradients, loss).run()


class LoopState(NamedTuple):
    """The fill-drain loop's variables. One counter per end of the pipeline, so that what the backward keeps of
    each index stays on its chunk's device."""

    last: tf.Tensor  # the last chunk's micro-batch counter (it writes the outputs)
    first: tf.Tensor  # the first chunk's micro-batch counter (it reads the micro-batches)
    weights: tuple  # per chunk, its weights, passed through unchanged (see the module doc)
    route_counters: tuple  # with batched weight gradients, per chunk, the counter indexing its placeholders
    aux_sums: tuple  # the sums of the auxiliary statistics (`PipelineJob.aux_spec`), flat
    outputs: tuple  # the output's leaves per micro-batch: TensorArrays on the last chunk; () with a loss
    head_weights: tuple = ()  # with a loss, the loss head's weights, passed through unchanged
    head_sums: tuple = ()  # with a loss when training, the sums of the head's weight gradients (seeded)
    values: tuple = ()  # with a loss, the sums of its values, in `FillDrainLoop.names` order


class FillDrainLoop:
    """The loop of the module doc for one job (and the task's loss, if given): `run` builds it, its gradient is
    TensorFlow's."""

    def __init__(self, job: PipelineJob, inputs: Any, parallel_iterations: int, batch_weight_gradients: bool | str,
                 loss: PipelineLoss | None = None) -> None:
        self.job, self.parallel_iterations, self.loss = job, parallel_iterations, loss
        self.batch_weight_gradients = batch_weight_gradients
        self.arguments = loop_parts.OpArguments.of(job, inputs, loss.head_weights if loss is not None else ())
        self.value_spec = loop_parts.loss_value_spec(loss, job) if loss is not None else {}
        self.names = sorted(self.value_spec)
        # Made inside the custom gradient (`forward`): the split inputs, the routing lists of batched weight
        # gradients, every output leaf (float or not), the loss's split targets, gradient seed and summed values,
        # and the summed aux statistics.
        self.micro: Any = None
        self.routed: batched_weights.RoutedStashes | None = None
        self.outputs: list[tf.Tensor] = []
        self.targets: Any = None
        self.seed: tf.Tensor | None = None
        self.values: dict[str, tf.Tensor] = {}
        self.aux_sums: dict[str, Any] | None = None

    def run(self) -> tuple[Any, dict[str, Any] | None]:
        """The loop as one `tf.custom_gradient` op: (outputs, or the loss's {name: sum}; summed aux statistics or
        None)."""
        job = self.job

        @tf.custom_gradient
        def pipeline(*args: tf.Tensor) -> Any:
            split = self.arguments.stopped(args, job.devices[0])
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
                final = self.forward(tape, split)
            returned = ([self.values[n] for n in self.names] if self.loss is not None
                        else [t for t in self.outputs if is_float(t)])
            return returned, lambda *dy: self.gradients(tape, split, final, returned, dy)

        returned = pipeline(*self.arguments.flat)
        if self.loss is not None:
            return dict(zip(self.names, returned)), self.aux_sums
        float_out = iter(returned)
        outputs = tf.nest.pack_sequence_as(job.output_spec,
                                           [next(float_out) if is_float(o) else o for o in self.outputs])
        return outputs, self.aux_sums

    def forward(self, tape: tf.GradientTape, split: loop_parts.SplitArguments) -> LoopState:
        """Every micro-batch through every chunk in one loop, recorded on `tape`: the final loop state (its weights
        are the ends of the gradient sums' loop variables); keeps the outputs or the loss's values, and the aux
        sums."""
        job, loss = self.job, self.loss
        tape.watch([w for ws in split.chunk_weights for w in ws] + (split.inputs if job.input_gradient else [])
                   + (split.head_weights if loss is not None and not job.training else []))
        with tf.device(job.devices[0]):
            self.micro = microbatch.split(with_float_leaves(self.arguments.inputs, split.inputs),
                                          job.num_micro_batches)
        self.routed = (_routed_stashes(job, split.chunk_weights, self.micro, self.batch_weight_gradients)
                       if self.batch_weight_gradients else None)
        if self.routed is not None:
            tape.watch(self.routed.sources)
        arrays, head_sums, values = (), (), ()
        with tf.device(job.devices[-1]):
            if loss is None:
                arrays = tuple(tf.TensorArray(sp.dtype, size=job.num_micro_batches, element_shape=sp.shape)
                               for sp in tf.nest.flatten(job.output_spec))
            else:
                self.targets = microbatch.split(loss.targets, job.num_micro_batches)
                if job.training:
                    self.seed = tf.constant(1.0) if loss.gradient_seed is None else tf.identity(loss.gradient_seed)
                    # Half-precision head weights (cast by the task) still sum their gradients in float32.
                    head_sums = tuple(loop_parts.step_zeros(w.shape, loop_parts.sum_dtype(w.dtype))
                                      for w in split.head_weights)
                values = tuple(tf.zeros(self.value_spec[n].shape, self.value_spec[n].dtype) for n in self.names)
            aux_zeros = tuple(tf.zeros(sp.shape, sp.dtype) for sp in tf.nest.flatten(job.aux_spec))
        last, first = loop_parts.counters([job.devices[-1], job.devices[0]])
        route_counters = tuple(loop_parts.counters(job.devices)) if self.routed is not None else ()
        # The weights are loop variables passed through unchanged: their gradient is a loop variable of the
        # backward loop that starts from the zeros made in `gradients`, on the chunk's device, and sums there.
        state = LoopState(last=last, first=first, weights=tuple(tuple(ws) for ws in split.chunk_weights),
                          route_counters=route_counters, aux_sums=aux_zeros, outputs=arrays,
                          head_weights=tuple(split.head_weights), head_sums=head_sums, values=values)
        final = loop_parts.host_loop(self.body, state, job.num_micro_batches, self.parallel_iterations)
        with tf.device(job.devices[-1]):
            self.outputs = [microbatch.merge(a.stack()) for a in final.outputs]
        self.values = dict(zip(self.names, final.values))
        if job.aux_spec:
            self.aux_sums = tf.nest.pack_sequence_as(job.aux_spec, list(final.aux_sums))
        return final

    def body(self, state: LoopState) -> LoopState:
        """One micro-batch through every chunk, then its output written (or its loss computed) on the last chunk."""
        job = self.job
        first, _, h, ctx = loop_parts.next_micro_batch(job, state.first, self.micro, bool(job.aux_spec))
        route_counters = []
        for c in range(job.num_chunks):
            with placement.on_stage(job.chunk_scopes[c]):
                # The chunk's own copy of its input: what the backward keeps of it stays here.
                h = tf.nest.map_structure(tf.identity, h)
                stash, extra = None, []
                if self.routed is not None:
                    route_counters.append(state.route_counters[c] + 1)
                    stash, extra = self.routed.stash(c), self.routed.placeholders(c, route_counters[-1] - 1)
                h = stage_op(loop_parts.chunk_fn(job, c, ctx), list(state.weights[c]) + extra, h,
                             c > 0 or job.input_gradient, job.plan.remat[c], job.devices[c], stash)
        state = state._replace(first=first, route_counters=tuple(route_counters))
        with placement.on_stage(job.chunk_scopes[-1]):
            last = state.last + 1
            index = last - 1  # a tensor of this chunk (the loop's own input would be kept elsewhere)
            if self.loss is None:
                state = state._replace(outputs=tuple(a.write(index, leaf)
                                                     for a, leaf in zip(state.outputs, tf.nest.flatten(h))))
            else:
                state = self.loss_step(state, h, index, ctx)
            if job.aux_spec:
                stats = loop_parts.aux_statistics(job, ctx)
                state = state._replace(aux_sums=tuple(total + st for total, st in zip(state.aux_sums, stats)))
        return state._replace(last=last)

    def loss_step(self, state: LoopState, outputs: Any, index: tf.Tensor, ctx: FPropContext) -> LoopState:
        """Micro-batch `index`'s loss on its `outputs` (on the last chunk), its values added to the sums. When
        training, one op whose gradient is the output gradient computed here (so TensorFlow's backward loop keeps
        that gradient, not the loss's logits), and the head's weight gradients added to their sums."""
        names = self.names
        if not self.job.training:
            got = loop_parts.micro_batch_loss(self.loss, state.head_weights, outputs, self.targets, index, None,
                                              ctx).values
            return state._replace(values=loop_parts.add_values(state.values, got, names))
        device = self.job.devices[-1]

        @tf.custom_gradient
        def loss_op(*outs: tf.Tensor) -> Any:
            cell = loop_parts.micro_batch_loss(self.loss, state.head_weights, with_float_leaves(outputs, list(outs)),
                                               self.targets, index, self.seed, ctx)

            def grad(*upstream: tf.Tensor) -> list[tf.Tensor]:
                with tf.device(device):
                    d_loss = upstream[names.index("loss")]
                    return [g * loop_parts.rescale(d_loss, self.seed, g.dtype) for g in cell.output_gradients]

            # The head's gradients leave through this op too: its gradient stops there, so TensorFlow's backward
            # loop never differentiates the loss's own backward (which would keep every micro-batch's logits).
            return [cell.values[n] for n in names] + list(cell.head_gradients), grad

        returned = loss_op(*float_leaves(outputs))
        head_sums = tuple(a + tf.cast(g, a.dtype) for a, g in zip(state.head_sums, returned[len(names):]))
        return state._replace(values=loop_parts.add_values(state.values, dict(zip(names, returned)), names),
                              head_sums=head_sums)

    def gradients(self, tape: tf.GradientTape, split: loop_parts.SplitArguments, final: LoopState,
                  returned: list[tf.Tensor], dy: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The op's gradients (in `OpArguments.flat` order): TensorFlow's backward loop, its gradient ops on their
        chunks' devices, with the batched W added after it where the weight gradients are routed; with a loss, the
        head's summed weight gradients rescaled to the caller's upstream gradient of the "loss" sum."""
        job = self.job
        if self.loss is not None:  # only the "loss" sum is differentiated; the other values are metric numerators
            loss_at = self.names.index("loss")
            returned, dy = [returned[loss_at]], [tf.zeros([], returned[loss_at].dtype) if dy[loss_at] is None
                                                 else dy[loss_at]]
        with tf.device(job.devices[-1]):
            dy = [tf.identity(d) for d in dy]
        # Outside training the loss is not one op of its own: TensorFlow differentiates it, in the backward loop, and
        # the head's weights (loop variables passed through, as the chunks') sum their gradients there.
        differentiated_head = self.loss is not None and not job.training
        weight_ends = list(final.weights) + ([final.head_weights] if differentiated_head else [])
        ends, starts = [], []
        for c, ws in enumerate(weight_ends):
            with tf.device(job.devices[min(c, job.num_chunks - 1)]):
                ends += list(ws)
                starts += [loop_parts.step_zeros(w.shape, w.dtype) for w in ws]
        flat_weights = [w for ws in split.chunk_weights for w in ws]
        inputs = split.inputs if job.input_gradient else []
        head_weights = split.head_weights if differentiated_head else []
        wrt = flat_weights + inputs + head_weights
        sources = self.routed.sources if self.routed is not None else []
        # Counters and the outputs (TensorArrays) live on the last chunk; so do their gradients.
        with placement.colocate_gradients(job.devices[-1], placement.host_device()):
            grads = tape.gradient(returned + ends, wrt + sources, output_gradients=dy + starts,
                                  unconnected_gradients=tf.UnconnectedGradients.NONE)
        if self.routed is not None:  # W: one matmul per watched weight, on its chunk's device
            grads[:len(flat_weights)] = self.routed.add_weight_gradients(grads[len(wrt):], grads[:len(flat_weights)])
        grads = [tf.zeros_like(t) if g is None else g for g, t in zip(grads[:len(wrt)], wrt)]
        sums = grads[:len(flat_weights)]
        dx = grads[len(flat_weights):len(flat_weights) + len(inputs)] or [tf.zeros_like(a) for a in split.inputs]
        head = grads[len(flat_weights) + len(inputs):]
        if self.loss is not None and job.training:  # the sums the loop made, seeded: rescaled to the caller's
            with tf.device(job.devices[-1]):
                head = loop_parts.head_gradients(final.head_sums, split.head_weights, dy[0], self.seed)
        return list(dx) + list(sums) + head


def chunk_matmul_calls(job: PipelineJob, thetas: Sequence[Sequence[tf.Tensor]],
                       micro: Any) -> list[list[batched_weights.MatmulCall]]:
    """Each chunk's watched matmuls (every weight watched), from one trace of `job`'s chunks on a micro-batch shaped
    as `micro`'s elements (`batched_weights.discover_calls`)."""
    def forward(x: Any, stashes: list) -> Any:
        ctx = job.micro_batch_context(tf.constant(0), bool(job.aux_spec))
        for c in range(job.num_chunks):
            with stashes[c].watching(thetas[c]):
                x = job.run_chunk(c, thetas[c], x, ctx)
        return x

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), micro)
    return batched_weights.discover_calls(forward, job.num_chunks, spec)


def auto_batched_calls(job: PipelineJob, thetas: Sequence[Sequence[tf.Tensor]], micro: Any,
                       where: str) -> tuple[list[list[batched_weights.MatmulCall]], list[frozenset[int]]] | None:
    """With `batch_weight_gradients="auto"`, both loops' choice: per chunk, the watched matmuls of the weights it
    batches and those weights' indices (`batched_weights.auto_selection`, logged under `where`); None when it
    batches none, or under XLA (`batched_weights.auto_applies`)."""
    if not batched_weights.auto_applies(job.compiled_chunks):
        return None
    calls = chunk_matmul_calls(job, thetas, micro)
    only = batched_weights.auto_selection(calls, job.num_micro_batches, where)
    if only is None:
        return None
    return [[c for c in chunk_calls if c.weight in chosen] for chunk_calls, chosen in zip(calls, only)], only


def _routed_stashes(job: PipelineJob, thetas: Sequence[Sequence[tf.Tensor]], micro: Any,
                    mode: bool | str) -> batched_weights.RoutedStashes | None:
    """The routing lists of batched weight gradients for `job` (mode True: every watched matmul; "auto": those
    `auto_batched_calls` chooses), or None when there are none."""
    if mode == batched_weights.AUTO:
        chosen = auto_batched_calls(job, thetas, micro, "FillDrain")
        if chosen is None:
            return None
        calls, only = chosen
    else:
        calls, only = chunk_matmul_calls(job, thetas, micro), None
    return batched_weights.RoutedStashes(job.devices, thetas, calls, job.num_micro_batches, only)
