"""The parts every schedule's loop shares (fill-drain's, the windowed loop's, the unrolled schedule's), used by
calling them: the op's flat arguments, the loop counters and micro-batches, one micro-batch's loss, the host loop,
the rescaled gradient.

Where things live, and why: `fill_drain.py`'s module doc. In short, the While op and its condition (the loop's
own iteration count) sit on this process's CPU, which runs no stage, so no stage has to answer before the next
micro-batch may start; each counter that indexes micro-batches starts on the stage that uses it, so what the
backward keeps of an index stays there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.leaves import float_leaves, with_float_leaves
from gpipe_tf.gpipe.schedule_base import PipelineJob, PipelineLoss
from gpipe_tf.layers import matmul_layout
from gpipe_tf.layers.base_layer import FPropContext


class SplitArguments(NamedTuple):
    """A schedule op's flat arguments by role."""

    inputs: list[tf.Tensor]  # the pipeline input's float leaves
    chunk_weights: list[list[tf.Tensor]]  # each chunk's weights
    head_weights: list[tf.Tensor]  # the loss head's weights (schedules that run the loss inside the loop)


@dataclasses.dataclass(frozen=True)
class OpArguments:
    """The flat arguments of a schedule's `tf.custom_gradient` op, the same for every loop: the inputs' float
    leaves, then each chunk's weights, then the loss head's weights. The op's gradient function returns their
    gradients in this order."""

    inputs: Any
    chunk_weights: tuple[tuple[tf.Tensor, ...], ...]
    head_weights: tuple[tf.Tensor, ...] = ()

    @classmethod
    def of(cls, job: PipelineJob, inputs: Any, head_weights: Sequence[tf.Tensor] = ()) -> OpArguments:
        """The arguments of `job` on `inputs`, with the loss head's weights if the loop runs the loss."""
        return cls(inputs, tuple(tuple(ws) for ws in job.chunk_weights), tuple(head_weights))

    @property
    def flat(self) -> list[tf.Tensor]:
        """Every argument, in the op's order."""
        return float_leaves(self.inputs) + [w for ws in self.chunk_weights for w in ws] + list(self.head_weights)

    def split(self, args: Sequence[tf.Tensor]) -> SplitArguments:
        """The op's `args` (in `flat`'s order) by role."""
        args = list(args)
        start = len(float_leaves(self.inputs))
        chunks = []
        for ws in self.chunk_weights:
            chunks.append(args[start:start + len(ws)])
            start += len(ws)
        return SplitArguments(args[:len(float_leaves(self.inputs))], chunks, args[start:])

    def stopped(self, args: Sequence[tf.Tensor], default_device: str) -> SplitArguments:
        """`split(args)` with each argument behind `tf.stop_gradient` on its own device (else `default_device`).

        Why: the op computes its gradients itself (or by a tape of its own), and with the caller's tape also
        watching the arguments TensorFlow wraps the loop in an extra function, which loses the loop's placement
        and order.
        """
        stopped = []
        for a in args:
            with tf.device(a.device or default_device):
                stopped.append(tf.stop_gradient(a))
        return self.split(stopped)


def counters(devices: Sequence[str]) -> list[tf.Tensor]:
    """One int32 zero per device in `devices`, made there: the loop counters of the stages that use them."""
    made = []
    for device in devices:
        with tf.device(device):
            made.append(tf.constant(0))
    return made


def ring(length: int) -> tuple[tf.Tensor, ...]:
    """A ring of `length` int32 tokens, made on the current device: a loop variable that orders cells."""
    return tuple(tf.constant(0) for _ in range(length))


def advance(tokens: tuple[tf.Tensor, ...], after: Sequence[Any]) -> tuple[tf.Tensor, ...]:
    """The ring `tokens` turned by one: its oldest token dropped, a new one made once `after` exists. A cell that
    waits for the ring's first token then waits for the work `len(tokens)` turns back."""
    with tf.control_dependencies(list(after)):
        done = tf.identity(tokens[-1])
    return tuple(tokens[1:]) + (done,)


def chunk_fn(job: PipelineJob, chunk: int, ctx: FPropContext) -> Callable[[Sequence[tf.Tensor], Any], Any]:
    """`fn(weights, inputs)`: chunk `chunk` of `job` on one micro-batch of context `ctx`, as `remat` runs it; with
    `jit_compile`, the chunk's XLA cells bound to `ctx` (`xla_cells.BoundCell`)."""
    if job.compiled_chunks is not None:
        return job.compiled_chunks[chunk].bind(ctx)

    def fn(weights: Sequence[tf.Tensor], inputs: Any) -> Any:
        return job.run_chunk(chunk, weights, inputs, ctx)
    return fn


def aux_statistics(job: PipelineJob, ctx: FPropContext) -> list[tf.Tensor]:
    """The auxiliary statistics (`PipelineJob.aux_spec`) one micro-batch's forward left in `ctx`, flat."""
    return tf.nest.flatten({path: ctx.aux[path] for path in job.aux_spec}) if job.aux_spec else []


def next_micro_batch(job: PipelineJob, counter: tf.Tensor, micro: Any,
                     collect_aux: bool) -> tuple[tf.Tensor, tf.Tensor, Any, FPropContext]:
    """On the first stage: (its counter advanced, the micro-batch's index, micro-batch `counter` of the split inputs
    `micro`, that micro-batch's context). The seed comes from the first stage, which leads the forward pass."""
    with placement.on_stage(job.chunk_scopes[0]):
        counter_next = counter + 1
        index = counter_next - 1
        inputs = tf.nest.map_structure(lambda t: t[index], micro)
        return counter_next, index, inputs, job.micro_batch_context(index, collect_aux)


def host_loop(body: Callable[[Any], Any], state: Any, num_micro_batches: int, parallel_iterations: int) -> Any:
    """`body` applied `num_micro_batches` times to `state` (any structure `tf.nest` handles, e.g. a NamedTuple) in
    one `tf.while_loop`, the While op and its condition (its iteration count, `maximum_iterations`) on this
    process's CPU (`placement.host_device`): the final state. With several iterations at once, a forward's
    transposed weight waits for its input (`matmul_layout.transposes_after_inputs` says why)."""
    condition = placement.host_device()
    gate = matmul_layout.transposes_after_inputs() if parallel_iterations > 1 else contextlib.nullcontext()
    with tf.compat.v1.get_default_graph().device(placement.loop_device(condition, condition)), gate:
        (final,) = tf.while_loop(lambda _: True, lambda s: (body(s),), (state,), maximum_iterations=num_micro_batches,
                                 parallel_iterations=parallel_iterations)
    return final


def sum_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype a gradient sum of `dtype` values is kept in: float32 for half precision, else `dtype` itself."""
    return tf.float32 if dtype in (tf.bfloat16, tf.float16) else dtype


def step_zeros(shape: Sequence[int] | tf.TensorShape, dtype: tf.DType) -> tf.Tensor:
    """Zeros of a static `shape`, made each time the step runs. `tf.zeros` and `tf.zeros_like` of a static shape
    are folded by Grappler into a constant (up to 10 MiB each) that the compiled function holds for its lifetime:
    a loop's gradient sums started from them kept one weight-sized buffer per weight between steps, beside the
    weights. A zero-initialized `Empty` is not folded (XLA compiles it too)."""
    return tf.raw_ops.Empty(shape=tf.constant(list(shape), tf.int32), dtype=dtype, init=True)


def rescale(upstream: tf.Tensor | None, seed: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """upstream / seed in `dtype`: the factor from gradients seeded with `seed` (a loop that ran its backward
    inside its forward) to the caller's gradients; zero where the caller's tape sent no gradient, and where the
    seed is zero (a batch of padding only: the task seeds zeros). Divided in float32 (or `dtype` if wider): a tiny
    loss scale over the normalizer underflows to zero in float16."""
    if upstream is None:
        return tf.zeros([], dtype)
    wide = dtype if dtype.size > 4 else tf.float32
    return tf.cast(tf.math.divide_no_nan(tf.cast(upstream, wide), tf.cast(seed, wide)), dtype)


def loss_value_spec(loss: PipelineLoss, job: PipelineJob) -> dict[str, tf.TensorSpec]:
    """The TensorSpecs of `loss.fn`'s values on one micro-batch of `job`, from a trace of it alone (no chunk runs).
    Raises ValueError unless they are a dict with a 'loss' entry."""
    m = job.num_micro_batches

    def spec(t: tf.Tensor) -> tf.TensorSpec:
        return tf.TensorSpec([t.shape[0] // m] + t.shape[1:], t.dtype)

    weight_specs = [tf.TensorSpec(w.shape, w.dtype) for w in loss.head_weights]
    target_specs = tf.nest.map_structure(spec, loss.targets)

    def trace(weights: list, outputs: Any, targets: Any) -> dict:
        return loss.fn(weights, outputs, targets, FPropContext(training=True, seed=tf.zeros([2], tf.int64)))

    traced = tf.function(trace, autograph=False).get_concrete_function(weight_specs, job.output_spec, target_specs)
    values = traced.structured_outputs
    if not isinstance(values, dict):
        raise ValueError(f"the pipeline's loss function returned {type(values).__name__}: it must return a dict of "
                         "scalar sums with a 'loss' entry")
    if "loss" not in values:
        raise ValueError(f"the pipeline's loss function returned {sorted(values)}: it must return a 'loss' entry")
    return {n: tf.TensorSpec(v.shape, v.dtype) for n, v in values.items()}


class MicroBatchLoss(NamedTuple):
    """One micro-batch's loss on the last chunk (`micro_batch_loss`)."""

    values: dict  # {name: this micro-batch's sum}, as `PipelineLoss.fn` returns them
    output_gradients: list[tf.Tensor]  # the gradient of the output's float leaves, seeded with the gradient seed
    head_gradients: list[tf.Tensor]  # the same for the loss head's weights


def micro_batch_loss(loss: PipelineLoss, head_weights: Sequence[tf.Tensor], outputs: Any, targets: Any,
                     index: tf.Tensor, seed: tf.Tensor | None, ctx: FPropContext) -> MicroBatchLoss:
    """Micro-batch `index`'s loss on its `outputs` (call under the last chunk's device and scope): its values and,
    given a gradient `seed` (a float32 scalar on this device), the gradients of seed x its "loss" value.

    targets: the targets split into micro-batches (`microbatch.split`), indexed here.
    """
    with tf.name_scope("loss"):
        outs = [tf.identity(t) for t in float_leaves(outputs)]
        # The loss of micro-batch i starts once its output exists. Its logits-sized tensors that need only the
        # targets (one-hot labels, the broadcast gradient seed) would otherwise be made for every micro-batch at
        # the start of the loop (the iterations run in parallel) and held until used.
        with tf.control_dependencies(outs):
            mine = tf.nest.map_structure(lambda t: tf.identity(t[index]), targets)
            seed = None if seed is None else tf.identity(seed)
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            tape.watch(outs + list(head_weights))
            got = loss.fn(list(head_weights), with_float_leaves(outputs, outs), mine, ctx)
    if seed is None:
        return MicroBatchLoss(got, [], [])
    with tf.name_scope("backward"):
        seed = tf.cast(seed, got["loss"].dtype)
        grads = tape.gradient(got["loss"], outs + list(head_weights), output_gradients=seed,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # The output gradient, which starts this micro-batch's backward, leaves once the loss's own sums exist:
        # the ops that only compute them (the argmax, the summed cross-entropy) are off the backward's path, and
        # a worker could otherwise run them late and hold the logits of several micro-batches until then.
        with tf.control_dependencies(list(got.values())):
            dy = [tf.identity(g) for g in grads[:len(outs)]]
    return MicroBatchLoss(got, dy, grads[len(outs):])


def add_values(sums: tuple, values: dict, names: Sequence[str]) -> tuple:
    """The loss's running `sums` (in `names` order) with one micro-batch's `values` added, each in its sum's dtype."""
    return tuple(a + tf.cast(values[n], a.dtype) for a, n in zip(sums, names))


def head_gradients(head_sums: Sequence[tf.Tensor], head_weights: Sequence[tf.Tensor], upstream: tf.Tensor | None,
                   seed: tf.Tensor) -> list[tf.Tensor]:
    """The head weights' gradient sums, seeded with `seed` in the loop, rescaled to the caller's `upstream`
    gradient of the "loss" sum and cast to each weight's dtype (call on the last chunk's device)."""
    return [tf.cast(g * rescale(upstream, seed, g.dtype), w.dtype) for g, w in zip(head_sums, head_weights)]
