"""The loop of the schedules whose loss runs inside the pipeline (1F1B, interleaved 1F1B): every micro-batch's
forward, loss and backward in one while loop, ordered by the schedule's order data (`orders.ScheduleOrder`'s
`in_flight` windows and `forward_waits`), a graph constant in M.

How, as one while loop:

* Iteration i is micro-batch i's whole journey: the forward of every stage, the loss, the backward of every stage,
  each stage's part under its device and name scope (``forward``, ``loss``, ``backward``), each stage's weight
  gradients summed into loop variables on its device. A stage's stashes are tensors of one iteration, so
  TensorFlow frees them as soon as that iteration's backward has used them; no tape spans iterations.
* A device runs the iterations' ops as their inputs arrive (`parallel_iterations` is M), so stage 0 starts
  micro-batch i+1 while stage 1 runs micro-batch i, as in fill-drain; what orders forwards and backwards is the
  order data, as rings of tokens, loop variables on the stage's device: with `in_flight[s]` = w, stage s has a
  ring of w tokens and its forward of micro-batch i waits for the token its backward of micro-batch i - w
  produced, so it never holds more than w micro-batches' stashes. A `forward_waits` entry (s, t, lag) is a ring
  of `lag` tokens filled by stage t's forwards and read by stage s's: F(s, i) waits for F(t, i - lag).
* The While op, the loop's counter and its condition (its iteration count) sit on this process's CPU, as in
  fill-drain (`fill_drain.py` says why); the counters that index micro-batches start on the stages that use them.
* The pipeline is one `tf.custom_gradient` op whose forward already computed the gradients (seeded with the
  loss's gradient seed, `PipelineLoss.gradient_seed`); its gradient function only rescales them by the caller's
  upstream gradient, on each stage's device.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from gpipe_tf.gpipe import batched_weights, fill_drain, loop_parts, microbatch, placement
from gpipe_tf.gpipe.leaves import float_leaves, with_float_leaves
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.remat import StageForward
from gpipe_tf.gpipe.schedule_base import PipelineJob, PipelineLoss, Schedule, stopped_arguments
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.weight_gradients import WeightStash


class WindowedSchedule(Schedule):
    """A schedule run by this loop: a subclass states only its order (`own_order`, with in-flight windows).

    Training runs forward, loss and backward in this loop; outside training (evaluation, or a caller without a
    loss) there is no backward order to keep, and fill-drain's forward loop runs.
    """

    needs_output_spec = True  # fill-drain's forward loop preallocates the outputs

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: batch_weight_gradients (`batched_weights.define_knob`)."""
        return batched_weights.define_knob(super().params())

    def __init__(self, params: InstantiableParams, path: str = "") -> None:
        super().__init__(params, path)
        batched_weights.check_knob(self.p, path)

    def own_order(self, num_devices: int) -> ScheduleOrder:
        """The schedule's order on `num_devices` devices, before its knobs (`step_order` applies them)."""
        raise NotImplementedError

    def step_order(self, num_devices: int) -> ScheduleOrder:
        """`own_order`, with its weight gradients batched if `batch_weight_gradients`."""
        return batched_weights.apply_knob(self.own_order(num_devices), self.p)

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """The forward pass alone, as fill-drain's loop."""
        return fill_drain.run_loop(job, inputs)

    def run_with_loss(self, job: PipelineJob, inputs: Any, loss: PipelineLoss) -> tuple[dict, dict[str, Any] | None]:
        """Forward, loss and backward of every micro-batch in this loop when training, in the schedule's order."""
        if not job.training:
            return super().run_with_loss(job, inputs, loss)
        return run(job, inputs, loss, self.step_order(job.plan.num_devices))


def run(job: PipelineJob, inputs: Any, loss: PipelineLoss, order: ScheduleOrder) -> tuple[dict, dict[str, Any] | None]:
    """Forward, loss and backward of every micro-batch of `job` in one loop ordered by `order` (its stages are
    the job's chunks): ({name: sum over the batch}, summed aux statistics or None); see the module doc."""
    if order.num_chunks != job.num_chunks or order.in_flight is None:
        raise ValueError(f"the {order.name} order has {order.num_chunks} stages and in_flight={order.in_flight}: "
                         f"this loop needs one in-flight window per chunk of the job ({job.num_chunks})")
    if len({s for s, _, _ in order.forward_waits}) != len(order.forward_waits):
        raise ValueError(f"the {order.name} order's forward_waits {order.forward_waits} give a stage two waits: "
                         "this loop keeps one forward ring per stage")
    k, m = job.num_chunks, job.num_micro_batches
    devices, scopes = job.devices, job.stage_scopes
    aux_spec = job.aux_spec
    flat_aux_spec = tf.nest.flatten(aux_spec)
    num_aux = len(flat_aux_spec)
    flat_inputs = float_leaves(inputs)
    flat_theta = [list(ws) for ws in job.stage_weights]
    head = list(loss.head_weights)
    input_gradient = job.input_gradient
    windows = order.in_flight
    weight_windows = order.weight_window  # None: the token of a backward also waits for its weight gradients
    batched = order.batched_weights  # each stage's matmul weight gradients wait in its stash for the last backward
    stash_layout = batched_weights.StashLayout(devices, job.stage_weights if batched else [[] for _ in range(k)])
    waits = {s: (t, lag) for s, t, lag in order.forward_waits}  # one forward ring per waiting stage
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
                 sums: tuple, head_sums: tuple, values: tuple, kept: tuple, *state: Any) -> tuple:
            tokens, forward_rings, weight_rings = rings
            stashes = [WeightStash() if batched else None for _ in range(k)]
            new_forward_rings = list(forward_rings)
            aux_sums, arrays = state[:num_aux], state[num_aux:]
            first_next, index, h, micro_ctx = loop_parts.next_micro_batch(job, first, micro, bool(aux_spec))
            records = []
            for s in range(k):
                with placement.on_stage(scopes[s]), tf.name_scope("forward"):
                    # Wait for the backward of micro-batch index - windows[s] on this stage (1F1B's order and
                    # its bound on stashes); the stage's own copy of its input stays on its device.
                    before = [tokens[s][0]] + ([forward_rings[waiting.index(s)][0]] if s in waits else [])
                    before += [weight_rings[s][0]] if weight_windows else []
                    with tf.control_dependencies(before):
                        h = tf.nest.map_structure(tf.identity, h)

                    def fn(ws: Sequence[tf.Tensor], x: Any, s: int = s) -> Any:
                        return job.run_stage(s, ws, x, micro_ctx)
                    records.append(StageForward(fn, weights[s], h, s > 0 or input_gradient, job.plan.remat[s],
                                                stashes[s]))
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
            new_sums, new_tokens, new_weight_rings, new_kept = [None] * k, [None] * k, [()] * k, list(kept)
            for s in reversed(range(k)):
                with placement.on_stage(scopes[s]), tf.name_scope("backward"):
                    dx, dw = records[s].gradient(dy)
                    # None: a weight whose whole gradient waits in the stash (batched W).
                    new_sums[s] = tuple(a if g is None else a + g for a, g in zip(sums[s], dw))
                    if batched:
                        new_kept[s] = stash_layout.keep(s, kept[s], stashes[s].records)
                    # Split orders (B, then W): the next forwards wait for the input gradient (B) only, and for
                    # the weight gradients (W) of weight_windows[s] micro-batches back through their own ring.
                    # A first stage without an input gradient has no B: its token waits for W, as in 1F1B.
                    split = bool(weight_windows) and bool(dx)
                    with tf.control_dependencies(list(dx) if split else list(new_sums[s]) + list(dx)):
                        done = tf.identity(tokens[s][-1])
                    new_tokens[s] = tuple(tokens[s][1:]) + (done,)
                    if weight_windows:
                        with tf.control_dependencies(list(new_sums[s])):
                            weight_done = tf.identity(weight_rings[s][-1])
                        new_weight_rings[s] = tuple(weight_rings[s][1:]) + (weight_done,)
                    dy = dx
            if input_gradient:
                with placement.on_stage(scopes[0]):
                    arrays = tuple(a.write(index, d) for a, d in zip(arrays, dy))
            rings = (tuple(new_tokens), tuple(new_forward_rings), tuple(new_weight_rings))
            return (first_next, last_next, weights, head_w, rings,
                    tuple(new_sums), head_sums, values, tuple(new_kept), *aux_sums, *arrays)

        initial_tokens, initial_sums, initial_weight_rings = [], [], []
        for s in range(k):
            with tf.device(devices[s]):
                initial_tokens.append(tuple(tf.constant(0) for _ in range(windows[s])))
                initial_weight_rings.append(tuple(tf.constant(0) for _ in range(weight_windows[s]))
                                            if weight_windows else ())
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
        out = loop_parts.host_loop(
            body, (*loop_parts.counters([devices[0], devices[-1]]), tuple(tuple(ws) for ws in thetas),
                   tuple(head_ws), (tuple(initial_tokens), tuple(initial_forward_rings), tuple(initial_weight_rings)),
                   tuple(initial_sums), head_zeros, value_zeros, stash_layout.empty(), *aux_zeros, *arrays), m, m)
        _, _, _, _, _, grad_sums, head_sums, values, kept, *state = out
        if batched:  # W: each stage's batched weight gradients, after its last backward, on its device
            grad_sums = [stash_layout.add_weight_gradients(s, kept[s], grad_sums[s], m) for s in range(k)]
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
