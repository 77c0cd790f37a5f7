"""The loop schedule: one `tf.while_loop` over micro-batches, its gradient a second loop.

The loop body runs stage 0, 1, ..., K-1 on micro-batch i, each under its stage's device and name scope; iterations
may overlap (`parallel_iterations`), which gives the fill-drain pipeline without a Python-unrolled M x K graph, so
trace and compile cost do not grow with M. The gradient of the loop is a second loop that starts after the whole
forward loop (GPipe's order) and keeps one running sum per weight. Stages under `tf.recompute_grad` keep only
their input per micro-batch. The task's `tape.gradient` runs under `placement.colocate_gradients()` so each
stage's backward ops stay on the stage's device.

Limitation, measured (README "Schedules"): TensorFlow lowers a while loop so that all of its loop state passes
through the loop's one device every iteration; the weight-gradient running sums of stages on other devices
therefore travel there and back per micro-batch. On one device, or logical CPUs in one process, that costs
nothing; across processes, hosts or GPUs prefer the unrolled schedule.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, placement, remat
from gpipe_tf.layers.base_layer import FPropContext


def run(pipe: Any, stage_theta: list[Any], inputs: Any, ctx: FPropContext) -> Any:
    """Runs `pipe` (a GPipe layer) over its micro-batches in one while loop; see the module doc."""
    k, m = pipe.p.num_stages, pipe.p.num_micro_batches
    with tf.device(pipe.devices[0]):
        micro_batches = microbatch.split(inputs, m)
    out_spec = pipe._output_structure(
        tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), micro_batches))
    flat_spec = tf.nest.flatten(out_spec)
    use_remat = [remat.stage_uses_remat(pipe.p.remat, s, k) for s in range(k)]
    # Batch norm statistics are summed over micro-batches in loop state and reported once for the step.
    aux_spec = pipe.aux_stats_spec() if ctx.training and ctx.aux is not None else {}
    flat_aux_spec = tf.nest.flatten(aux_spec)
    num_aux = len(flat_aux_spec)

    def body(i: tf.Tensor, *state: Any) -> tuple:
        aux_sums, arrays = state[:num_aux], state[num_aux:]
        with tf.device(pipe.devices[0]):
            x = tf.nest.map_structure(lambda t: t[i], micro_batches)
        micro_ctx = pipe.micro_batch_context(ctx, i, bool(aux_spec))
        for stage in range(k):
            with placement.on_stage(pipe.stage_scopes[stage]):
                def run(theta_s: Any, x_s: Any, stage: int = stage) -> Any:
                    return pipe._run_stage(stage, theta_s, x_s, micro_ctx)
                x = remat.rematerialize(run, stage_theta[stage], x) if use_remat[stage] else run(
                    stage_theta[stage], x)
        with tf.device(pipe.devices[-1]):
            arrays = tuple(a.write(i, leaf) for a, leaf in zip(arrays, tf.nest.flatten(x)))
            if aux_spec:
                stats = tf.nest.flatten({path: micro_ctx.aux[path] for path in aux_spec})
                aux_sums = tuple(total + s for total, s in zip(aux_sums, stats))
        return (i + 1, *aux_sums, *arrays)

    with tf.device(pipe.devices[-1]):
        arrays = tuple(tf.TensorArray(s.dtype, size=m, element_shape=s.shape) for s in flat_spec)
        aux_zeros = tuple(tf.zeros(s.shape, s.dtype) for s in flat_aux_spec)
    _, *state = tf.while_loop(lambda i, *_: i < m, body, (tf.constant(0), *aux_zeros, *arrays),
                              parallel_iterations=pipe.p.parallel_iterations or k)
    if aux_spec:
        ctx.aux.update(tf.nest.pack_sequence_as(aux_spec, state[:num_aux]))
    with tf.device(pipe.devices[-1]):
        flat_out = [microbatch.merge(a.stack()) for a in state[num_aux:]]
    return tf.nest.pack_sequence_as(out_spec, flat_out)
