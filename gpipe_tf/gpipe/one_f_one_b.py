"""One forward, one backward (PipeDream-Flush, "1F1B"): the loss inside the pipeline, a bounded number of
micro-batches in flight per stage, a graph constant in M.

GPipe's fill-drain runs every forward before any backward, so each stage keeps all M micro-batches' stashes
(inputs, and activations without rematerialization) until the drain. Here the last stage computes each
micro-batch's loss (`PipelineLoss`, handed over by the task) and its gradient right after its forward pass, so a
micro-batch's backward can start while later micro-batches still run forward, and stage k starts the forward of
micro-batch i only after its backward of micro-batch i - (K - k) is done: it holds at most K - k micro-batches'
stashes, whatever M. The bubble is fill-drain's, (K-1)/(M+K-1); the math is the same synchronous mini-batch step.

How, as one while loop (the graph does not grow with M):

* Iteration i is micro-batch i's whole journey: the forward of every stage, the loss, the backward of every stage,
  each stage's part under its device and name scope (``forward``, ``loss``, ``backward``), each stage's weight
  gradients summed into loop variables on its device. A stage's stashes are tensors of one iteration, so
  TensorFlow frees them as soon as that iteration's backward has used them; no tape spans iterations.
* A device runs the iterations' ops as their inputs arrive (`parallel_iterations` is M), so stage 0 starts
  micro-batch i+1 while stage 1 runs micro-batch i, as in fill-drain; what orders forwards and backwards is a
  ring of K - k tokens per stage, loop variables on the stage's device: the forward of micro-batch i on stage k
  waits for the token its backward of micro-batch i - (K - k) produced. In the steady state each stage then
  alternates one forward and one backward, the 1F1B order, and its stashes never exceed K - k micro-batches.
* The While op, the loop's counter and its condition (its iteration count) sit on this process's CPU, as in
  fill-drain (`fill_drain.py` says why); the counters that index micro-batches start on the stages that use them.
* The pipeline is one `tf.custom_gradient` op whose forward already computed the gradients (seeded with the
  loss's gradient seed, `PipelineLoss.gradient_seed`); its gradient function only rescales them by the caller's
  upstream gradient, on each stage's device.

Outside training (evaluation, or a caller that runs the pipeline without a loss) the schedule runs fill-drain's
forward loop (`FillDrain.run`), which needs no backward order.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, placement
from gpipe_tf.gpipe.fill_drain import FillDrain
from gpipe_tf.gpipe.leaves import float_leaves, with_float_leaves
from gpipe_tf.gpipe.remat import StageForward
from gpipe_tf.gpipe.schedule_base import PipelineJob, PipelineLoss, Schedule, stopped_arguments
from gpipe_tf.layers.base_layer import FPropContext


class OneForwardOneBackward(FillDrain):
    """PipeDream-Flush's 1F1B order as one placed while loop: stage k holds at most K - k micro-batches."""

    order = "one_f_one_b"

    def in_flight(self, job: PipelineJob) -> list[int]:
        """How many micro-batches each stage may hold at once (its forward done, its backward not): K - k."""
        k = job.num_chunks
        return [k - s for s in range(k)]

    def forward_waits(self, job: PipelineJob) -> dict[int, tuple[int, int]]:
        """{stage s: (stage t, lag)}: the forward of micro-batch i on s also waits for t's forward of micro-batch
        i - lag (on the same device; a further order between stages). None here."""
        return {}

    def run_with_loss(self, job: PipelineJob, inputs: Any, loss: PipelineLoss) -> tuple[dict, dict[str, Any] | None]:
        """Forward, loss and backward of every micro-batch in one loop; see the module doc."""
        if not job.training:
            return Schedule.run_with_loss(self, job, inputs, loss)
        k, m = job.num_chunks, job.num_micro_batches
        devices, scopes = job.devices, job.stage_scopes
        aux_spec = job.aux_spec
        flat_aux_spec = tf.nest.flatten(aux_spec)
        num_aux = len(flat_aux_spec)
        flat_inputs = float_leaves(inputs)
        flat_theta = [list(ws) for ws in job.stage_weights]
        head = list(loss.head_weights)
        input_gradient = job.input_gradient
        windows = self.in_flight(job)
        waits = self.forward_waits(job)
        waiting = sorted(waits)  # the stages with a forward ring, in loop-variable order
        fills = {}  # {stage t: [index into `waiting`]}: the rings the forward of t fills
        for j, s in enumerate(waiting):
            fills.setdefault(waits[s][0], []).append(j)
        value_spec = _loss_value_spec(loss, job, m)
        names = sorted(value_spec)
        if "loss" not in value_spec:
            raise ValueError(f"the pipeline's loss function returned {names}: it must return a 'loss' entry")
        result = {}  # filled inside the custom gradient: the summed aux statistics

        @tf.custom_gradient
        def pipeline(*args: tf.Tensor) -> Any:
            xs, thetas, head_ws = stopped_arguments(args, devices[0], len(flat_inputs), [len(f) for f in flat_theta])
            with tf.device(devices[0]):
                micro = microbatch.split(with_float_leaves(inputs, xs), m)
            with tf.device(devices[-1]):
                targets = microbatch.split(loss.targets, m)
                seed = tf.constant(1.0) if loss.gradient_seed is None else tf.identity(loss.gradient_seed)

            def body(first: tf.Tensor, last: tf.Tensor, weights: tuple, head_w: tuple, rings: tuple,
                     sums: tuple, head_sums: tuple, values: tuple, *state: Any) -> tuple:
                tokens, forward_rings = rings
                new_forward_rings = list(forward_rings)
                aux_sums, arrays = state[:num_aux], state[num_aux:]
                with placement.on_stage(scopes[0]):
                    first_next = first + 1
                    index = first_next - 1
                    h = tf.nest.map_structure(lambda t: t[index], micro)
                    micro_ctx = job.micro_batch_context(index, bool(aux_spec))
                records = []
                for s in range(k):
                    with placement.on_stage(scopes[s]), tf.name_scope("forward"):
                        # Wait for the backward of micro-batch index - windows[s] on this stage (1F1B's order and
                        # its bound on stashes); the stage's own copy of its input stays on its device.
                        before = [tokens[s][0]] + ([forward_rings[waiting.index(s)][0]] if s in waits else [])
                        with tf.control_dependencies(before):
                            h = tf.nest.map_structure(tf.identity, h)

                        def fn(ws: Sequence[tf.Tensor], x: Any, s: int = s) -> Any:
                            return job.run_stage(s, ws, x, micro_ctx)
                        records.append(StageForward(fn, weights[s], h, s > 0 or input_gradient, job.plan.remat[s]))
                        h = records[-1].outputs
                        for j in fills.get(s, []):
                            with tf.control_dependencies(float_leaves(h)):
                                done = tf.identity(forward_rings[j][-1])
                            new_forward_rings[j] = tuple(forward_rings[j][1:]) + (done,)
                stats = tf.nest.flatten({path: micro_ctx.aux[path] for path in aux_spec}) if aux_spec else []
                with placement.on_stage(scopes[-1]):
                    last_next = last + 1
                    index_last = last_next - 1
                    with tf.name_scope("loss"):
                        tgt = tf.nest.map_structure(lambda t: t[index_last], targets)
                        outs = [tf.identity(t) for t in float_leaves(h)]
                        tape = tf.GradientTape(watch_accessed_variables=False)
                        with tape:
                            tape.watch(outs + list(head_w))
                            got = loss.fn(list(head_w), with_float_leaves(h, outs), tgt, micro_ctx)
                    with tf.name_scope("backward"):
                        seed_here = tf.cast(seed, got["loss"].dtype)
                        grads = tape.gradient(got["loss"], outs + list(head_w), output_gradients=seed_here,
                                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    dy = grads[:len(outs)]
                    head_sums = tuple(a + tf.cast(g, a.dtype) for a, g in zip(head_sums, grads[len(outs):]))
                    values = tuple(a + tf.cast(got[n], a.dtype) for a, n in zip(values, names))
                    aux_sums = tuple(total + st for total, st in zip(aux_sums, stats))
                new_sums, new_tokens = [None] * k, [None] * k
                for s in reversed(range(k)):
                    with placement.on_stage(scopes[s]), tf.name_scope("backward"):
                        dx, dw = records[s].gradient(dy)
                        new_sums[s] = tuple(a + g for a, g in zip(sums[s], dw))
                        with tf.control_dependencies(list(new_sums[s]) + list(dx)):
                            done = tf.identity(tokens[s][-1])
                        new_tokens[s] = tuple(tokens[s][1:]) + (done,)
                        dy = dx
                if input_gradient:
                    with placement.on_stage(scopes[0]):
                        arrays = tuple(a.write(index, d) for a, d in zip(arrays, dy))
                return (first_next, last_next, weights, head_w, (tuple(new_tokens), tuple(new_forward_rings)),
                        tuple(new_sums), head_sums, values, *aux_sums, *arrays)

            initial_tokens, initial_sums = [], []
            for s in range(k):
                with tf.device(devices[s]):
                    initial_tokens.append(tuple(tf.constant(0) for _ in range(windows[s])))
                    initial_sums.append(tuple(tf.zeros_like(w) for w in thetas[s]))
            initial_forward_rings = []
            for s in waiting:
                with tf.device(devices[waits[s][0]]):  # filled by stage t's forward, read by s on the same device
                    initial_forward_rings.append(tuple(tf.constant(0) for _ in range(waits[s][1])))
            with tf.device(devices[-1]):
                # Half-precision head weights (cast by the task) still sum their gradients in float32.
                head_zeros = tuple(tf.zeros(w.shape, _sum_dtype(w.dtype)) for w in head_ws)
                value_zeros = tuple(tf.zeros(value_spec[n].shape, value_spec[n].dtype) for n in names)
                aux_zeros = tuple(tf.zeros(sp.shape, sp.dtype) for sp in flat_aux_spec)
            with tf.device(devices[0]):
                arrays = tuple(tf.TensorArray(x.dtype, size=m, element_shape=[x.shape[0] // m] + x.shape[1:])
                               for x in xs) if input_gradient else ()
            counters = []
            for device in (devices[0], devices[-1]):
                with tf.device(device):
                    counters.append(tf.constant(0))
            condition = placement.host_device()
            with tf.compat.v1.get_default_graph().device(placement.loop_device(condition, condition)):
                out = tf.while_loop(
                    lambda *_: True, body,
                    (*counters, tuple(tuple(ws) for ws in thetas), tuple(head_ws),
                     (tuple(initial_tokens), tuple(initial_forward_rings)),
                     tuple(initial_sums), head_zeros, value_zeros, *aux_zeros, *arrays),
                    maximum_iterations=m, parallel_iterations=m)
            _, _, _, _, _, grad_sums, head_sums, values, *state = out
            if aux_spec:
                result["aux"] = tf.nest.pack_sequence_as(aux_spec, state[:num_aux])
            dx_arrays = state[num_aux:]

            def grad_fn(*upstream: tf.Tensor) -> list[tf.Tensor]:
                d_loss = upstream[names.index("loss")]
                grads = []
                with tf.device(devices[0]):
                    if input_gradient:
                        for a, x in zip(dx_arrays, xs):
                            grads.append(microbatch.merge(a.stack()) * _rescale(d_loss, seed, x.dtype))
                    else:
                        grads += [tf.zeros_like(x) for x in xs]
                for s in range(k):
                    with tf.device(devices[s]):
                        grads += [g * _rescale(d_loss, seed, g.dtype) for g in grad_sums[s]]
                with tf.device(devices[-1]):
                    grads += [tf.cast(g * _rescale(d_loss, seed, g.dtype), w.dtype) for g, w in zip(head_sums, head_ws)]
                return grads

            return list(values), grad_fn

        flat_values = pipeline(*flat_inputs, *[w for flat in flat_theta for w in flat], *head)
        return dict(zip(names, flat_values)), result.get("aux")


def _sum_dtype(dtype: tf.DType) -> tf.DType:
    """float32 for half-precision values, else their own dtype."""
    return tf.float32 if dtype in (tf.bfloat16, tf.float16) else dtype


def _rescale(upstream: tf.Tensor | None, seed: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """upstream / seed in `dtype`: the factor from gradients seeded with `seed` to the caller's gradients."""
    if upstream is None:
        return tf.zeros([], dtype)
    return tf.cast(upstream, dtype) / tf.cast(seed, dtype)


def _loss_value_spec(loss: PipelineLoss, job: PipelineJob, m: int) -> dict[str, tf.TensorSpec]:
    """The TensorSpecs of `loss.fn`'s values on one micro-batch, from a trace of it alone (no stage runs)."""
    def spec(t: tf.Tensor, batched: bool = True) -> tf.TensorSpec:
        shape = t.shape
        if batched:
            shape = [shape[0] // m] + shape[1:]
        return tf.TensorSpec(shape, t.dtype)

    weight_specs = [tf.TensorSpec(w.shape, w.dtype) for w in loss.head_weights]
    target_specs = tf.nest.map_structure(spec, loss.targets)

    def trace(weights: list, outputs: Any, targets: Any) -> dict:
        return loss.fn(weights, outputs, targets, FPropContext(training=True, seed=tf.zeros([2], tf.int64)))

    traced = tf.function(trace, autograph=False).get_concrete_function(weight_specs, job.output_spec, target_specs)
    values = traced.structured_outputs
    if not isinstance(values, dict):
        raise ValueError(f"the pipeline's loss function returned {type(values).__name__}: it must return a dict of "
                         "scalar sums with a 'loss' entry")
    return {n: tf.TensorSpec(v.shape, v.dtype) for n, v in values.items()}
