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

from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, placement
from gpipe_tf.gpipe.leaves import depends_on_variables, float_leaves, is_float, with_float_leaves
from gpipe_tf.layers.base_layer import FPropContext


def run(pipe: Any, stage_theta: list[Any], inputs: Any, ctx: FPropContext) -> Any:
    """Runs `pipe` (a GPipe layer) as an unrolled, explicitly placed schedule; see the module doc."""
    k, m = pipe.p.num_stages, pipe.p.num_micro_batches
    use_remat = pipe.plan.remat
    aux_spec = pipe.aux_stats_spec() if ctx.training and ctx.aux is not None else {}
    flat_inputs = float_leaves(inputs)
    flat_theta = [tf.nest.flatten(t) for t in stage_theta]
    sizes = [len(f) for f in flat_theta]
    output: dict[str, Any] = {}

    @tf.custom_gradient
    def pipeline(*args: tf.Tensor) -> Any:
        theta_args, start = [], len(flat_inputs)
        for size in sizes:
            theta_args.append(list(args[start:start + size]))
            start += size
        thetas = [tf.nest.pack_sequence_as(stage_theta[s], theta_args[s]) for s in range(k)]
        with tf.device(pipe.devices[0]):
            micro = microbatch.split_list(with_float_leaves(inputs, list(args[:len(flat_inputs)])), m)
        # records[s][i] = (stage input, tape or None, stage output)
        records: list[list[Any]] = [[None] * m for _ in range(k)]
        outs, aux_parts = [], []
        for i in range(m):
            micro_ctx = pipe.micro_batch_context(ctx, i, bool(aux_spec))
            h = micro[i]
            for s in range(k):
                with placement.on_stage(pipe.stage_scopes[s]):
                    if use_remat[s]:
                        y, tape = pipe._run_stage(s, thetas[s], h, micro_ctx), None
                    else:
                        # Fresh identities: if the boundary holds one tensor twice, e.g. (x, x), each position
                        # must get its own gradient, not the sum of both (which would be counted twice upstream).
                        h = with_float_leaves(h, [tf.identity(t) for t in float_leaves(h)])
                        tape = tf.GradientTape(watch_accessed_variables=False)
                        with tape:
                            tape.watch(float_leaves(h) + theta_args[s])
                            y = pipe._run_stage(s, thetas[s], h, micro_ctx)
                records[s][i] = (h, tape, y)
                h = y
            outs.append(h)
            if aux_spec:
                aux_parts.append(micro_ctx.aux)
        with tf.device(pipe.devices[-1]):
            flat_outs = [tf.concat(parts, axis=0) for parts in zip(*[tf.nest.flatten(o) for o in outs])]
            if aux_spec:
                output["aux"] = {path: tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)),
                                                             *[part[path] for part in aux_parts])
                                 for path in aux_spec}
        output["structure"] = outs[0]

        def grad_fn(*upstream: tf.Tensor) -> list[Any]:
            out_is_float = [is_float(t) for t in tf.nest.flatten(outs[0])]
            with tf.device(pipe.devices[-1]):
                float_upstream = [tf.split(g, m, axis=0) for g, f in zip(upstream, out_is_float) if f]
            # updates[s]: the last in-place additions into stage s's gradient sums (pipe.gradient_sums[s]).
            updates: list[list[Any] | None] = [None] * k
            input_grads = []
            wanted = pipe.p.input_gradients
            needs_input_grad = depends_on_variables(flat_inputs) if wanted == "auto" else bool(wanted)
            for i in reversed(range(m)):
                dy = [parts[i] for parts in float_upstream]
                recompute_ctx = pipe.micro_batch_context(ctx, i, False)
                for s in reversed(range(k)):
                    h, tape, y = records[s][i]
                    with placement.on_stage(pipe.stage_scopes[s]):
                        # B(k, i) after B(k, i+1): one partial weight gradient per stage at a time. Waiting for dy
                        # also keeps the recomputation distinct from the forward pass (no common-subexpression
                        # merge), so rematerialized activations really are freed in between.
                        with tf.control_dependencies((updates[s] or []) + dy):
                            h_float = [tf.identity(t) for t in float_leaves(h)]
                            if tape is None:
                                tape = tf.GradientTape(watch_accessed_variables=False)
                                with tape:
                                    tape.watch(h_float + theta_args[s])
                                    y = pipe._run_stage(s, thetas[s], with_float_leaves(h, h_float), recompute_ctx)
                            else:
                                h_float = float_leaves(h)
                            # A data batch needs no gradient: skip stage 0's input gradient (a whole matmul per layer
                            # input) unless something trainable produced the pipeline's input.
                            wrt = h_float if s > 0 or needs_input_grad else []
                            grads = tape.gradient(float_leaves(y), wrt + theta_args[s], output_gradients=dy,
                                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
                        weight_grads = grads[len(wrt):]
                        add = "assign" if updates[s] is None else "assign_add"  # the first one needs no zeroing
                        updates[s] = [getattr(acc, add)(g, read_value=False)
                                      for acc, g in zip(pipe.gradient_sums[s], weight_grads)]
                        dy = grads[:len(wrt)]
                input_grads.append(dy)
            with tf.device(pipe.devices[0]):
                if needs_input_grad:
                    dx = [tf.concat(parts[::-1], axis=0) for parts in zip(*input_grads)]
                else:
                    dx = [tf.zeros_like(t) for t in flat_inputs]
            sums = []
            for s in range(k):
                with tf.device(pipe.devices[s]), tf.control_dependencies(updates[s]):
                    sums += [acc.read_value() for acc in pipe.gradient_sums[s]]
            return dx + sums

        return flat_outs, grad_fn

    flat_out = pipeline(*flat_inputs, *[t for f in flat_theta for t in f])
    if aux_spec:
        ctx.aux.update(output["aux"])
    return tf.nest.pack_sequence_as(output["structure"], list(flat_out))
