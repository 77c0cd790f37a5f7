"""The fill-drain schedule as one while loop: a graph constant in M, every stage's state on its own device.

Forward: one `tf.while_loop` over micro-batches; its body runs stage 0, 1, ..., K-1 on micro-batch i, each under
its stage's device and name scope. Each device runs its part of the loop on its own, so stage 0 starts micro-batch
i+1 while stage 1 runs micro-batch i, which gives GPipe's fill (`parallel_iterations`, default 1, is per device). Backward: TensorFlow's gradient of that loop, a second loop that starts once the whole output
gradient exists (all forwards, then all backwards, micro-batches in reverse), so the graph does not grow with M.

Where things live, and why (checked on the placed graph, `tests/test_pipeline.py`):

* A lowered while loop places each loop variable's nodes with its initial value, and runs its condition (and
  any unplaced body node) on the While op's device (`placement.loop_device`). Every op here is built under its
  stage's device; the loop counters start on the stage that uses them (the last stage's also drives the
  condition; the first stage has its own for reading micro-batches), so what the backward keeps of an index
  stays there too.
* The While ops themselves (forward and backward) sit on this process's CPU (`placement.host_device()`), which
  runs no stage. A single-thread worker handles a message only when its current chain of ops ends, so a
  condition computed on a busy stage delays every other stage's next micro-batch: with the While op on a stage,
  step times on single-thread workers switched between pipelined and serial from run to run.
* Each stage's weights are loop variables passed through unchanged, so TensorFlow's backward loop sums their
  gradients in loop variables that start from zeros made here on the stage's device. (In-place additions into
  variables would be stateful ops, and a lowered loop starts its next iteration only after all of the
  previous iteration's stateful ops: the backward would not overlap stages at all.)
* Each stage runs as one op (`stage_op`) whose gradient runs on the stage's device; each stage first copies its
  input there, so the stashes TensorFlow keeps for the backward (stage inputs; with remat off also activations)
  are pushed on that device. Only boundary activations, their gradients and the loop control cross devices.
* Rematerialization is the same op recomputing its forward pass in its gradient, once the boundary gradient
  has arrived. `tf.recompute_grad` is not used: inside a while loop it cannot read variables, and its weight
  gradients would be summed from zeros on the default device.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, placement
from gpipe_tf.gpipe.leaves import depends_on_variables, float_leaves, is_float, with_float_leaves
from gpipe_tf.layers.base_layer import FPropContext


def stage_op(fn: Callable[[Sequence[tf.Tensor], Any], Any], weights: Sequence[tf.Tensor], inputs: Any,
             input_gradient: bool, recompute: bool, device: str) -> Any:
    """Runs `fn(weights, inputs)` (one stage on one micro-batch) as one op with its own gradient, on `device`.

    recompute: keep nothing but `inputs` (and the weights, which the loop passes through unchanged); the gradient
    runs `fn` again once the output gradient has arrived, so that TensorFlow cannot merge the recomputation with
    the forward pass. Otherwise the activations recorded in the forward pass are kept for the gradient.
    """
    floats = float_leaves(inputs) if input_gradient else []
    num_x = len(floats)
    structure: list[Any] = []

    @tf.custom_gradient
    def op(*args: tf.Tensor) -> Any:
        xs, ws = list(args[:num_x]), list(args[num_x:])

        def forward(xs_: Sequence[tf.Tensor]) -> tuple[Any, tf.GradientTape, list[tf.Tensor]]:
            fresh = [tf.identity(t) for t in xs_]  # one gradient per position, even if a tensor appears twice
            tape = tf.GradientTape(watch_accessed_variables=False, persistent=True)
            with tape:
                tape.watch(fresh + ws)
                out = fn(ws, with_float_leaves(inputs, fresh) if input_gradient else inputs)
            return out, tape, fresh

        if recompute:
            y, tape, fresh = fn(ws, with_float_leaves(inputs, xs) if input_gradient else inputs), None, []
        else:
            y, tape, fresh = forward(xs)
        structure.append(y)
        float_y = float_leaves(y)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            with tf.device(device):
                if not recompute:
                    return tape.gradient(float_y, list(fresh) + ws, output_gradients=list(dys),
                                         unconnected_gradients=tf.UnconnectedGradients.ZERO)
                with tf.control_dependencies(dys):  # recompute only once the output gradient has arrived
                    local_x = [tf.identity(t) for t in xs]
                    local_w = [tf.identity(w) for w in ws]
                if tf.executing_eagerly():
                    local_y, local_tape, local_x = forward(local_x)
                    return local_tape.gradient(float_leaves(local_y), list(local_x) + ws, output_gradients=list(dys),
                                               unconnected_gradients=tf.UnconnectedGradients.ZERO)
                local_y = float_leaves(fn(local_w, with_float_leaves(inputs, local_x) if input_gradient else inputs))
                return symbolic_gradients(local_y, local_x + local_w, list(dys))

        return float_y, grad

    float_out = op(*floats, *weights)
    return with_float_leaves(structure[0], float_out)


def symbolic_gradients(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                       dys: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """d(ys)/d(xs) given the gradients `dys` of `ys`, built symbolically in graph mode (a tape when eager).

    Inside a backward while loop, a `tf.GradientTape` opened to record the recomputation made TensorFlow keep
    every iteration's weight gradients in the loop (one stage's weights' worth of memory per micro-batch,
    measured); `tf.gradients` builds the same gradient without that.
    """
    if tf.executing_eagerly():
        raise NotImplementedError("eager: record the recomputation on a tf.GradientTape instead")
    return tf.gradients(list(ys), list(xs), grad_ys=list(dys), unconnected_gradients=tf.UnconnectedGradients.ZERO)


def run(pipe: Any, stage_theta: list[Any], inputs: Any, ctx: FPropContext) -> Any:
    """Runs `pipe` (a GPipe layer) over its micro-batches in one placed while loop; see the module doc."""
    k, m = pipe.p.num_stages, pipe.p.num_micro_batches
    devices = pipe.devices
    use_remat = pipe.plan.remat
    aux_spec = pipe.aux_stats_spec() if ctx.training and ctx.aux is not None else {}
    flat_aux_spec = tf.nest.flatten(aux_spec)
    num_aux = len(flat_aux_spec)
    flat_inputs = float_leaves(inputs)
    flat_theta = [tf.nest.flatten(t) for t in stage_theta]
    wanted = pipe.p.input_gradients
    input_gradient = depends_on_variables(flat_inputs) if wanted == "auto" else bool(wanted)
    size = microbatch.check_divisible(inputs, m) // m
    out_spec = pipe._output_structure(
        tf.nest.map_structure(lambda t: tf.TensorSpec([size] + t.shape[1:], t.dtype), inputs))
    flat_spec = tf.nest.flatten(out_spec)
    result: dict[str, Any] = {}

    @tf.custom_gradient
    def pipeline(*args: tf.Tensor) -> Any:
        # stop_gradient hides the arguments from the caller's tape: with two tapes watching it, TensorFlow wraps
        # the loop in an extra function, which loses the placement and the ordering below.
        stopped = []
        for a in args:
            with tf.device(a.device or devices[0]):
                stopped.append(tf.stop_gradient(a))
        xs = stopped[:len(flat_inputs)]
        thetas, start = [], len(flat_inputs)
        for flat in flat_theta:
            thetas.append(stopped[start:start + len(flat)])
            start += len(flat)
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            flat_weights = [w for ws in thetas for w in ws]
            tape.watch(flat_weights + (xs if input_gradient else []))
            with tf.device(devices[0]):
                micro = microbatch.split(with_float_leaves(inputs, xs), m)

            def body(i: tf.Tensor, first: tf.Tensor, weights: tuple, *state: Any) -> tuple:
                # i, the condition's counter, lives on the last stage; the first stage has its own, so that what
                # the backward keeps of each index stays on its stage's device.
                aux_sums, arrays = state[:num_aux], state[num_aux:]
                with placement.on_stage(pipe.stage_scopes[0]):
                    first_next = first + 1
                    index = first_next - 1
                    h = tf.nest.map_structure(lambda t: t[index], micro)
                micro_ctx = pipe.micro_batch_context(ctx, i, bool(aux_spec))
                for s in range(k):
                    with placement.on_stage(pipe.stage_scopes[s]):
                        # The stage's own copy of its input: what the backward keeps of it stays on this device.
                        h = tf.nest.map_structure(tf.identity, h)

                        def fn(ws: Sequence[tf.Tensor], x: Any, s: int = s) -> Any:
                            return pipe._run_stage(s, tf.nest.pack_sequence_as(stage_theta[s], list(ws)), x,
                                                   micro_ctx)
                        h = stage_op(fn, weights[s], h, s > 0 or input_gradient, use_remat[s], devices[s])
                with placement.on_stage(pipe.stage_scopes[-1]):
                    index = (i + 1) - 1  # a tensor of this stage (the loop's own input would be kept elsewhere)
                    arrays = tuple(a.write(index, leaf) for a, leaf in zip(arrays, tf.nest.flatten(h)))
                    if aux_spec:
                        stats = tf.nest.flatten({path: micro_ctx.aux[path] for path in aux_spec})
                        aux_sums = tuple(total + st for total, st in zip(aux_sums, stats))
                return (i + 1, first_next, weights, *aux_sums, *arrays)

            with tf.device(devices[-1]):
                arrays = tuple(tf.TensorArray(sp.dtype, size=m, element_shape=sp.shape) for sp in flat_spec)
                aux_zeros = tuple(tf.zeros(sp.shape, sp.dtype) for sp in flat_aux_spec)
            condition = placement.host_device()
            counters = []
            for device in (devices[-1], devices[0]):
                with tf.device(device):
                    counters.append(tf.constant(0))
            with tf.compat.v1.get_default_graph().device(placement.loop_device(devices[-1], condition)):
                # The weights are loop variables passed through unchanged: their gradient is a loop variable of
                # the backward loop that starts from the zeros below, on the stage's device, and sums there.
                _, _, weights_out, *state = tf.while_loop(
                    lambda i, *_: i < m, body, (*counters, tuple(tuple(ws) for ws in thetas), *aux_zeros, *arrays),
                    parallel_iterations=pipe.p.parallel_iterations)
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
            # Counters and the outputs (TensorArrays) live on the last stage; so do their gradients.
            with placement.colocate_gradients(devices[-1], condition):
                grads = tape.gradient(out_float + ends, wrt, output_gradients=dy + starts,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            sums = grads[:len(flat_weights)]
            dx = grads[len(flat_weights):] if input_gradient else [tf.zeros_like(a) for a in xs]
            return list(dx) + list(sums)

        return out_float, grad_fn

    float_out = pipeline(*flat_inputs, *[w for flat in flat_theta for w in flat])
    if aux_spec:
        ctx.aux.update(result["aux"])
    floats = iter(float_out)
    return tf.nest.pack_sequence_as(out_spec, [next(floats) if is_float(o) else o for o in result["out"]])
