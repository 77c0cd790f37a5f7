"""The fill-drain schedule as one while loop: a graph constant in M, every stage's state on its own device.

Forward: one `tf.while_loop` over micro-batches; its body runs stage 0, 1, ..., K-1 on micro-batch i, each under
its stage's device and name scope. Each device runs its part of the loop on its own, so stage 0 starts micro-batch
i+1 while stage 1 runs micro-batch i, which gives GPipe's fill (`parallel_iterations`, default 1, is per device).
Backward: TensorFlow's gradient of that loop, a second loop that starts once the whole output gradient exists
(all forwards, then all backwards, micro-batches in reverse), so the graph does not grow with M.

Where things live, and why (checked on the placed graph, `tests/test_pipeline.py`):

* A lowered while loop places each loop variable's nodes with its initial value, and runs its condition (and
  any unplaced body node) on the While op's device (`placement.loop_device`). Every op here is built under its
  stage's device; the loop counters start on the stage that uses them (the first stage reads micro-batches and
  makes each one's seed with its own; the last stage writes outputs with its own), so what the backward keeps of
  an index stays there too.
* The While ops themselves (forward and backward) sit on this process's CPU (`placement.host_device()`), which
  runs no stage, and the forward loop's condition is its own iteration count (`maximum_iterations`), kept
  there too: the next micro-batch never waits for a stage's answer. A single-thread worker handles a message
  only when its current chain of ops ends, so a condition that needed a busy stage (the last stage's counter,
  as it once did) held the first stage's next forward until the last stage finished the current one: the
  forward ran the stages in turn (measured: 2.42 s against 1.99 s per step on workload (a), K=2, M=8). The
  backward loop's counter and condition sit on the host too (`placement.colocate_gradients`); with them on
  the last stage the weight-heavy workload's step was 1.2x the unrolled schedule's, with them here 1.1x.
* Each stage's weights are loop variables passed through unchanged, so TensorFlow's backward loop sums their
  gradients in loop variables that start from zeros made here on the stage's device. (In-place additions into
  variables would be stateful ops, and a lowered loop starts its next iteration only after all of the
  previous iteration's stateful ops: the backward would not overlap stages at all.)
* Each stage runs as one op (`stage_op`) whose gradient runs on the stage's device; each stage first copies its
  input there, so the stashes TensorFlow keeps for the backward (stage inputs; with remat off also activations)
  are pushed on that device. Only boundary activations, their gradients and the loop control cross devices.
* Rematerialization is the same op recomputing its forward pass in its gradient, once the boundary gradient
  has arrived (`remat.stage_op`; `remat.py` says why not `tf.recompute_grad`).
* With `batch_weight_gradients`, the matmul weights' gradients are not summed in the backward loop: each matmul's
  input and output gradient leave the loop as the gradients of TensorLists the forward reads placeholders from,
  and after it each weight's gradient is one matmul on its stage's device (`batched_weights.RoutedStashes`).
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from gpipe_tf.gpipe import batched_weights, loop_parts, microbatch, orders, placement
from gpipe_tf.gpipe.leaves import float_leaves, is_float, with_float_leaves
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.remat import stage_op
from gpipe_tf.gpipe.schedule_base import PipelineJob, Schedule, stopped_arguments
from gpipe_tf.hyperparams import InstantiableParams, ParamsError


class FillDrain(Schedule, short_name="fill_drain"):
    """GPipe's fill-drain order as one placed while loop and its gradient: a graph constant in M (the default)."""

    needs_output_spec = True  # the loop writes each micro-batch's output into preallocated TensorArrays

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: parallel_iterations, batch_weight_gradients."""
        p = super().params()
        p.define("parallel_iterations", 1, "Loop iterations (micro-batches) each device runs at once. 1 (default): a "
                 "stage works on one micro-batch at a time while the other stages work on theirs; higher values "
                 "measured no faster on single-thread workers and use more memory.")
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
        return batched_weights.apply_knob(orders.fill_drain(num_devices), self.p)

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """Runs the job's micro-batches in one placed while loop; see the module doc."""
        return run_loop(job, inputs, self.p.parallel_iterations, self.p.batch_weight_gradients and job.training)


def run_loop(job: PipelineJob, inputs: Any, parallel_iterations: int = 1,
             batch_weight_gradients: bool = False) -> tuple[Any, dict[str, Any] | None]:
    """The fill-drain loop of the module doc on `job`: (outputs, summed aux statistics or None). Also the forward
    pass of the schedules that run their backward inside the forward (1F1B) when no gradient is taken.

    parallel_iterations: loop iterations (micro-batches) each device runs at once.
    batch_weight_gradients: route the watched matmuls' inputs and output gradients out of the backward loop and
      compute each weight's gradient once after it (`batched_weights.RoutedStashes`).
    """
    k, m = job.num_chunks, job.num_micro_batches
    devices, scopes = job.devices, job.stage_scopes
    aux_spec = job.aux_spec
    flat_aux_spec = tf.nest.flatten(aux_spec)
    num_aux = len(flat_aux_spec)
    flat_inputs = float_leaves(inputs)
    flat_theta = [list(ws) for ws in job.stage_weights]
    input_gradient = job.input_gradient
    flat_spec = tf.nest.flatten(job.output_spec)
    result: dict[str, Any] = {}

    @tf.custom_gradient
    def pipeline(*args: tf.Tensor) -> Any:
        xs, thetas, _ = stopped_arguments(args, devices[0], len(flat_inputs), [len(f) for f in flat_theta])
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            flat_weights = [w for ws in thetas for w in ws]
            tape.watch(flat_weights + (xs if input_gradient else []))
            with tf.device(devices[0]):
                micro = microbatch.split(with_float_leaves(inputs, xs), m)
            routed = _routed_stashes(job, thetas, micro) if batch_weight_gradients else None
            if routed is not None:
                tape.watch(routed.sources)

            def body(i: tf.Tensor, first: tf.Tensor, weights: tuple, counters: tuple, *state: Any) -> tuple:
                # One counter per end of the pipeline (first: the first stage's; i: the last stage's), so
                # that what the backward keeps of each index stays on its stage's device; with batched weight
                # gradients, one per stage (`counters`) for the index of its placeholders.
                aux_sums, arrays = state[:num_aux], state[num_aux:]
                first_next, _, h, micro_ctx = loop_parts.next_micro_batch(job, first, micro, bool(aux_spec))
                counters_next = []
                for s in range(k):
                    with placement.on_stage(scopes[s]):
                        # The stage's own copy of its input: what the backward keeps of it stays here.
                        h = tf.nest.map_structure(tf.identity, h)

                        def fn(ws: Sequence[tf.Tensor], x: Any, s: int = s) -> Any:
                            return job.run_stage(s, ws, x, micro_ctx)
                        stash, extra = None, []
                        if routed is not None:
                            counters_next.append(counters[s] + 1)
                            stash, extra = routed.stash(s), routed.placeholders(s, counters_next[-1] - 1)
                        h = stage_op(fn, list(weights[s]) + extra, h, s > 0 or input_gradient, job.plan.remat[s],
                                     devices[s], stash)
                with placement.on_stage(scopes[-1]):
                    i_next = i + 1
                    index = i_next - 1  # a tensor of this stage (the loop's own input would be kept elsewhere)
                    arrays = tuple(a.write(index, leaf) for a, leaf in zip(arrays, tf.nest.flatten(h)))
                    if aux_spec:
                        stats = tf.nest.flatten({path: micro_ctx.aux[path] for path in aux_spec})
                        aux_sums = tuple(total + st for total, st in zip(aux_sums, stats))
                return (i_next, first_next, weights, tuple(counters_next), *aux_sums, *arrays)

            with tf.device(devices[-1]):
                arrays = tuple(tf.TensorArray(sp.dtype, size=m, element_shape=sp.shape) for sp in flat_spec)
                aux_zeros = tuple(tf.zeros(sp.shape, sp.dtype) for sp in flat_aux_spec)
            condition = placement.host_device()
            # The weights are loop variables passed through unchanged: their gradient is a loop variable of the
            # backward loop that starts from the zeros below, on the stage's device, and sums there.
            stage_counters = tuple(loop_parts.counters(devices)) if routed is not None else ()
            _, _, weights_out, _, *state = loop_parts.host_loop(
                body, (*loop_parts.counters([devices[-1], devices[0]]), tuple(tuple(ws) for ws in thetas),
                       stage_counters, *aux_zeros, *arrays), m, parallel_iterations)
            with tf.device(devices[-1]):
                flat_out = [microbatch.merge(a.stack()) for a in state[num_aux:]]
        if aux_spec:
            result["aux"] = tf.nest.pack_sequence_as(aux_spec, state[:num_aux])
        result["out"] = flat_out
        out_float = [t for t in flat_out if is_float(t)]

        def grad_fn(*dy: tf.Tensor) -> list[tf.Tensor]:
            with tf.device(devices[-1]):
                dy = [tf.identity(d) for d in dy]
            ends, starts = [], []
            for s in range(k):
                with tf.device(devices[s]):
                    ends += list(weights_out[s])
                    starts += [tf.zeros_like(w) for w in weights_out[s]]
            wrt = flat_weights + (xs if input_gradient else [])
            sources = routed.sources if routed is not None else []
            # Counters and the outputs (TensorArrays) live on the last stage; so do their gradients.
            with placement.colocate_gradients(devices[-1], condition):
                grads = tape.gradient(out_float + ends, wrt + sources, output_gradients=dy + starts,
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
            if routed is not None:  # W: one matmul per watched weight, on its stage's device
                grads[:len(flat_weights)] = routed.add_weight_gradients(grads[len(wrt):], grads[:len(flat_weights)])
            grads = [tf.zeros_like(t) if g is None else g for g, t in zip(grads[:len(wrt)], wrt)]
            sums = grads[:len(flat_weights)]
            dx = grads[len(flat_weights):] if input_gradient else [tf.zeros_like(a) for a in xs]
            return list(dx) + list(sums)

        return out_float, grad_fn

    float_out = pipeline(*flat_inputs, *[w for flat in flat_theta for w in flat])
    floats = iter(float_out)
    outputs = tf.nest.pack_sequence_as(job.output_spec,
                                       [next(floats) if is_float(o) else o for o in result["out"]])
    return outputs, result.get("aux")


def _routed_stashes(job: PipelineJob, thetas: Sequence[Sequence[tf.Tensor]],
                    micro: Any) -> batched_weights.RoutedStashes:
    """The routing lists of batched weight gradients for `job`, from one trace of its stages on a micro-batch shaped
    as `micro`'s elements."""
    def forward(x: Any, stashes: list) -> Any:
        ctx = job.micro_batch_context(tf.constant(0), bool(job.aux_spec))
        for s in range(job.num_chunks):
            with stashes[s].watching(thetas[s]):
                x = job.run_stage(s, thetas[s], x, ctx)
        return x

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), micro)
    calls = batched_weights.discover_calls(forward, job.num_chunks, spec)
    return batched_weights.RoutedStashes(job.devices, thetas, calls, job.num_micro_batches)
