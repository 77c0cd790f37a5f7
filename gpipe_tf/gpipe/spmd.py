"""The SPMD pipeline: a uniform stack's K stages as one program over a stage axis (Praxis, late Lingvo).

For TPUs, where one XLA program per replica with the stage axis split over cores is the native form
(lingvo/core/gshard_layers.py, LayerwiseShardablePipelinedLayer). Every stage must hold the same layers (a stack of
Transformer layers cut into equal stages): their weights are stacked along a leading stage axis, and one step is a
loop of M + K - 1 iterations over a buffer of K slots, one per stage. Iteration t feeds micro-batch t to slot 0 and
each slot k the output slot k - 1 computed in iteration t - 1, runs every stage on its slot at once
(`tf.vectorized_map` over the stage axis: one batched op per layer op, the axis XLA's SPMD partitioner would split
over cores), and keeps the last stage's output, micro-batch t - K + 1's once t >= K - 1. The first K - 1 iterations
of the last stages, and the last K - 1 of the first ones, compute on zeros whose results nothing reads: the bubble,
spent as in GPipe's own order. The loop is a `tf.while_loop`, so the graph does not grow with M, and its gradient is
TensorFlow's.

Unsharded, the program runs on one device: the first stage's. Refused, with the reason: a stack whose stages
differ in their weights' shapes or whose stage changes the shape it passes on, batch-norm statistics (`aux`),
and random numbers in training (the stage function is traced once, from stage 0's layers, so every stage would
draw stage 0's dropout masks).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, orders
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.schedule_base import PipelineJob, Schedule
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers import matmul_layout


class SpmdPipeline(Schedule, short_name="spmd"):
    """A uniform stack's stages as one program over a stage axis, on one device (see the module doc)."""

    needs_output_spec = True

    def step_order(self, num_devices: int) -> ScheduleOrder:
        """GPipe's fill-drain order: iteration t runs stage k on micro-batch t - k, and the backward mirrors it."""
        return orders.fill_drain(num_devices)

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """The loop of the module doc on the first stage's device: (outputs, None)."""
        _check_uniform(job, inputs, self.path)
        k, m = job.num_chunks, job.num_micro_batches
        ctx = job.micro_batch_context(0, False)
        with tf.device(job.devices[0]):
            stacked = [tf.stack([job.chunk_weights[s][i] for s in range(k)])
                       for i in range(len(job.chunk_weights[0]))]
            micro = microbatch.split(inputs, m)  # leaves [M, micro-batch, ...]
            slots = tf.nest.map_structure(lambda t: tf.zeros([k] + t.shape[1:], t.dtype), micro)
            outputs = tf.nest.map_structure(
                lambda sp: tf.TensorArray(sp.dtype, size=m + k - 1, element_shape=sp.shape), job.output_spec)

            def stage(args: tuple) -> Any:
                weights, x = args
                with matmul_layout.plain():  # vectorized: batched matmuls, outside the layout rule
                    return job.run_chunk(0, list(weights), x, ctx)

            def body(t: tf.Tensor, slots: Any, outputs: Any) -> tuple:
                fed = tf.nest.map_structure(lambda mb: tf.gather(mb, tf.minimum(t, m - 1)), micro)
                shifted = tf.nest.map_structure(lambda new, old: tf.concat([new[None], old[:-1]], 0), fed, slots)
                out = tf.vectorized_map(stage, (stacked, shifted))
                outputs = tf.nest.map_structure(lambda a, o: a.write(t, o[-1]), outputs, out)
                return t + 1, out, outputs

            _, _, outputs = tf.while_loop(lambda t, *_: t < m + k - 1, body, (tf.constant(0), slots, outputs),
                                          maximum_iterations=m + k - 1)
            result = tf.nest.map_structure(lambda a: microbatch.merge(a.stack()[k - 1:]), outputs)
        return result, None


def _check_uniform(job: PipelineJob, inputs: Any, path: str) -> None:
    """Raises ParamsError where the stack is not one the SPMD pipeline runs (see the module doc)."""
    first = [(tuple(w.shape), w.dtype) for w in job.chunk_weights[0]]
    for s, weights in enumerate(job.chunk_weights[1:], start=1):
        if [(tuple(w.shape), w.dtype) for w in weights] != first:
            raise ParamsError(f"{path}.schedule=spmd needs every stage to hold the same layers, but stage {s}'s "
                              "weights differ from stage 0's in number or shape; balance the stack into equal "
                              "stages (e.g. balance=[n, n, ...] of identical layers) or use another schedule")
    micro = tf.nest.map_structure(lambda t: tf.TensorSpec([t.shape[0] // job.num_micro_batches] + t.shape[1:],
                                                          t.dtype), inputs)
    if tf.nest.flatten(job.output_spec) != tf.nest.flatten(micro):
        raise ParamsError(f"{path}.schedule=spmd passes each stage's output to the next stage's slot, so a stage "
                          f"must keep its input's shape: {micro} in, {job.output_spec} out; use another schedule")
    if job.aux_spec:
        raise ParamsError(f"{path}.schedule=spmd cannot collect batch-norm statistics ({sorted(job.aux_spec)}); "
                          "use another schedule")
    if job.training and _draws_random_numbers(job, micro):
        raise ParamsError(f"{path}.schedule=spmd traces one stage function from stage 0's layers, so every stage "
                          "would draw stage 0's random numbers; set the stack's dropout rates to 0 or use another "
                          "schedule")


def _draws_random_numbers(job: PipelineJob, micro: Any) -> bool:
    ctx = job.micro_batch_context(tf.constant(0), False)
    specs = [tf.TensorSpec(w.shape, w.dtype) for w in job.chunk_weights[0]]
    graph = tf.function(lambda w, x: job.run_chunk(0, w, x, ctx), autograph=False).get_concrete_function(
        specs, micro).graph
    return any(op.type.startswith("StatelessRandom") for op in graph.get_operations())
