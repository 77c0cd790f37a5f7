"""The fill-drain schedule as one while loop: a graph constant in M, every stage's state on its own device.

Forward: one `tf.while_loop` over micro-batches; its body runs stage 0, 1, ..., K-1 on micro-batch i, each under
its stage's device and name scope, and up to `parallel_iterations` (default K) micro-batches are in flight, which
gives GPipe's fill. Backward: TensorFlow's gradient of that loop, a second loop that starts once the whole output
gradient exists (all forwards, then all backwards, micro-batches in reverse), so the graph does not grow with M.

Where things live, and why (checked on the placed graph, `tests/test_pipeline.py`):

* A lowered while loop puts every loop node on the While op's device when it has one, so all loop state would
  cross to that device each micro-batch. The loop is built without a device (`placement.loop_device`); each loop
  variable then stays where its initial value was made (outputs on the last stage, stashes on their stage).
* TensorFlow's own loop gradient would keep each weight's gradient sum as a loop variable whose initial zeros
  it makes on the default device. Instead each stage runs as one op (`stage_op`) whose gradient adds the
  weight gradient in place into that stage's gradient-sum variables on its device, and gives back only the
  input gradient (the boundary). The stashes TensorFlow keeps for the backward (stage inputs; with remat off
  also activations) are pushed on the stage's device, where each stage first copies its input.
* Rematerialization is the same op recomputing its forward pass in its gradient, once the boundary gradient
  has arrived. `tf.recompute_grad` cannot be used here: its weight gradients would become loop-carried sums on
  the default device (the problem above) and, inside a while loop, it cannot read variables.

Measured limit (README "How the pipeline works"): on single-thread TF workers the backward loop overlaps the
stages less than the unrolled schedule does, so at K=2 a step takes longer than `unrolled`'s; its forward loop
is as fast.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, placement, remat
from gpipe_tf.gpipe.leaves import depends_on_variables, float_leaves, is_float, with_float_leaves
from gpipe_tf.layers.base_layer import FPropContext


def stage_op(fn: Callable[[Sequence[tf.Tensor], Any], Any], weights: Sequence[tf.Tensor],
             sum_handles: Sequence[tf.Tensor], token: tf.Tensor, inputs: Any, input_gradient: bool, recompute: bool,
             device: str) -> Any:
    """Runs `fn(weights, inputs)` (one stage on one micro-batch) as an op whose gradient adds the gradients of
    `weights` into the variables behind `sum_handles` (in place, on `device`) and returns only the input gradient.

    `token` (a float scalar the caller watches) gets a gradient that depends on the additions by data, so that
    reading the sums after the loop's gradient sees all of them. recompute: keep nothing but `inputs`; the
    gradient runs `fn` again once the output gradient has arrived.
    """
    floats = float_leaves(inputs) if input_gradient else []
    structure: list[Any] = []

    @tf.custom_gradient
    def op(token_in: tf.Tensor, *xs: tf.Tensor) -> Any:
        # The gradient may only use what the forward pass captured into this graph (a cond branch checks it).
        graph = tf.compat.v1.get_default_graph()
        local_weights = [graph.capture(w) for w in weights]
        handles = [graph.capture(h) for h in sum_handles]

        def forward(xs_: Sequence[tf.Tensor]) -> tuple[Any, tf.GradientTape, list[tf.Tensor]]:
            fresh = [tf.identity(t) for t in xs_]  # one gradient per position, even if a tensor appears twice
            tape = tf.GradientTape(watch_accessed_variables=False, persistent=True)
            with tape:
                tape.watch(fresh + local_weights)
                out = fn(local_weights, with_float_leaves(inputs, fresh) if input_gradient else inputs)
            return out, tape, fresh

        if recompute:
            y, tape, fresh = fn(local_weights, with_float_leaves(inputs, xs) if input_gradient else inputs), None, None
        else:
            y, tape, fresh = forward(xs)
        structure.append(y)
        float_y = float_leaves(y)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            with tf.device(device):
                local_tape, local_x, local_y = tape, fresh, float_y
                if recompute:
                    # Waiting for the output gradient keeps the recomputation apart from the forward pass.
                    with tf.control_dependencies(dys):
                        local_y, local_tape, local_x = forward([tf.identity(t) for t in xs])
                    local_y = float_leaves(local_y)
                grads = local_tape.gradient(local_y, list(local_x) + local_weights, output_gradients=list(dys),
                                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
                updates = [tf.raw_ops.AssignAddVariableOp(resource=h, value=g)
                           for h, g in zip(handles, grads[len(local_x):])]
                # A data dependency on every update (control edges alone were lost through the loop gradient).
                with tf.control_dependencies(updates):
                    probes = [tf.cast(tf.reshape(tf.raw_ops.ReadVariableOp(resource=h, dtype=w.dtype), [-1])[:1],
                                      token_in.dtype) for h, w in zip(handles, weights)]
                dtoken = tf.reduce_sum(tf.concat(probes, 0)) * 0.0 if probes else tf.zeros_like(token_in)
            return [dtoken] + list(grads[:len(local_x)])

        return float_y, grad

    float_out = op(token, *floats)
    return with_float_leaves(structure[0], float_out)


def run(pipe: Any, stage_theta: list[Any], inputs: Any, ctx: FPropContext) -> Any:
    """Runs `pipe` (a GPipe layer) over its micro-batches in one placed while loop; see the module doc."""
    k, m = pipe.p.num_stages, pipe.p.num_micro_batches
    devices = pipe.devices
    use_remat = [remat.stage_uses_remat(pipe.p.remat, s, k) for s in range(k)]
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
        tokens = []
        for s in range(k):
            with tf.device(devices[s]):
                tokens.append(tf.zeros([], tf.float32))
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            tape.watch(tokens + (xs if input_gradient else []))
            with tf.device(devices[0]):
                micro = microbatch.split(with_float_leaves(inputs, xs), m)

            def body(i: tf.Tensor, *state: Any) -> tuple:
                aux_sums, arrays = state[:num_aux], state[num_aux:]
                graph = tf.compat.v1.get_default_graph()
                with tf.device(devices[0]):
                    h = tf.nest.map_structure(lambda t: t[i], micro)
                micro_ctx = pipe.micro_batch_context(ctx, i, bool(aux_spec))
                for s in range(k):
                    with placement.on_stage(pipe.stage_scopes[s]):
                        # The stage's own copy of its input: what the backward keeps of it stays on this device.
                        h = tf.nest.map_structure(tf.identity, h)

                        def fn(weights: Sequence[tf.Tensor], x: Any, s: int = s) -> Any:
                            return pipe._run_stage(s, tf.nest.pack_sequence_as(stage_theta[s], list(weights)), x,
                                                   micro_ctx)
                        handles = [graph.capture(v.handle) for v in pipe.gradient_sums[s]]
                        h = stage_op(fn, thetas[s], handles, tokens[s], h, s > 0 or input_gradient, use_remat[s],
                                     devices[s])
                with tf.device(devices[-1]):
                    arrays = tuple(a.write(i, leaf) for a, leaf in zip(arrays, tf.nest.flatten(h)))
                    if aux_spec:
                        stats = tf.nest.flatten({path: micro_ctx.aux[path] for path in aux_spec})
                        aux_sums = tuple(total + st for total, st in zip(aux_sums, stats))
                return (i + 1, *aux_sums, *arrays)

            with tf.device(devices[-1]):
                arrays = tuple(tf.TensorArray(sp.dtype, size=m, element_shape=sp.shape) for sp in flat_spec)
                aux_zeros = tuple(tf.zeros(sp.shape, sp.dtype) for sp in flat_aux_spec)
            with tf.device(devices[0]):
                i0 = tf.constant(0)
            with tf.compat.v1.get_default_graph().device(placement.loop_device(devices[0])):
                _, *state = tf.while_loop(lambda i, *_: i < m, body, (i0, *aux_zeros, *arrays),
                                          parallel_iterations=pipe.p.parallel_iterations or k)
            with tf.device(devices[-1]):
                flat_out = [microbatch.merge(a.stack()) for a in state[num_aux:]]
        if aux_spec:
            result["aux"] = tf.nest.pack_sequence_as(aux_spec, state[:num_aux])
        result["out"] = flat_out
        out_float = [t for t in flat_out if is_float(t)]

        def grad_fn(*dy: tf.Tensor) -> list[tf.Tensor]:
            zeroed = []
            for s in range(k):
                with tf.device(devices[s]):
                    zeroed += [acc.assign(tf.zeros_like(acc), read_value=False) for acc in pipe.gradient_sums[s]]
            with tf.control_dependencies(zeroed), tf.device(devices[-1]):
                dy = [tf.identity(d) for d in dy]
            wrt = tokens + (xs if input_gradient else [])
            with placement.colocate_gradients():
                grads = tape.gradient(out_float, wrt, output_gradients=dy,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            dx = grads[k:] if input_gradient else [tf.zeros_like(a) for a in xs]
            sums = []
            # Each token's gradient depends on its stage's additions by data (see stage_op).
            with tf.control_dependencies(grads[:k]):
                for s in range(k):
                    with tf.device(devices[s]):
                        sums += [acc.read_value() for acc in pipe.gradient_sums[s]]
            return list(dx) + sums

        return out_float, grad_fn

    float_out = pipeline(*flat_inputs, *[w for flat in flat_theta for w in flat])
    if aux_spec:
        ctx.aux.update(result["aux"])
    floats = iter(float_out)
    return tf.nest.pack_sequence_as(out_spec, [next(floats) if is_float(o) else o for o in result["out"]])
