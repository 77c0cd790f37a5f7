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

from typing import Any, Sequence

import tensorflow as tf

from gpipe_tf.gpipe import microbatch, orders, placement
from gpipe_tf.gpipe.leaves import float_leaves, is_float, with_float_leaves
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.plan import StagePlan
from gpipe_tf.gpipe.remat import StageForward
from gpipe_tf.gpipe.schedule_base import PipelineJob, Schedule


class Unrolled(Schedule, short_name="unrolled"):
    """GPipe's fill-drain order with every (stage, micro-batch) step its own op group; the graph grows with M.

    State: one gradient sum per weight, stage and replica, a variable on the stage's device, allocated once.
    """

    def __init__(self, params: Any, path: str = "") -> None:
        super().__init__(params, path)
        self.gradient_sums: list[list[list[tf.Variable]]] = []  # [replica][stage][weight]

    def step_order(self, num_devices: int) -> ScheduleOrder:
        """GPipe's order, as `FillDrain`'s: every forward, then the backwards from the last micro-batch to the
        first."""
        return orders.fill_drain(num_devices)

    def allocate(self, plan: StagePlan, stage_variables: Sequence[Sequence[tf.Variable]]) -> None:
        """One gradient sum per weight next to it, for every replica's devices."""
        for r, devices in enumerate(plan.devices or ()):
            sums = []
            for stage, variables in enumerate(stage_variables):
                with tf.device(devices[stage]):
                    sums.append([tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                             name=f"{self.path}/gradient_sum_{r}_{stage}_{j}")
                                 for j, v in enumerate(variables)])
            self.gradient_sums.append(sums)

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """Runs the job as an unrolled, explicitly placed schedule; see the module doc."""
        k, m = job.num_chunks, job.num_micro_batches
        aux_spec = job.aux_spec
        flat_inputs = float_leaves(inputs)
        flat_theta = [list(ws) for ws in job.stage_weights]
        sizes = [len(f) for f in flat_theta]
        gradient_sums = self.gradient_sums[job.replica]
        output: dict[str, Any] = {}

        @tf.custom_gradient
        def pipeline(*args: tf.Tensor) -> Any:
            theta_args, start = [], len(flat_inputs)
            for size in sizes:
                theta_args.append(list(args[start:start + size]))
                start += size
            with tf.device(job.devices[0]):
                micro = microbatch.split_list(with_float_leaves(inputs, list(args[:len(flat_inputs)])), m)
            records: list[list[StageForward | None]] = [[None] * m for _ in range(k)]
            outs, aux_parts = [], []
            for i in range(m):
                micro_ctx = job.micro_batch_context(i, bool(aux_spec))
                h = micro[i]
                for s in range(k):
                    with placement.on_stage(job.stage_scopes[s]):
                        def fn(ws: Sequence[tf.Tensor], x: Any, s: int = s, ctx: Any = micro_ctx) -> Any:
                            return job.run_stage(s, ws, x, ctx)
                        records[s][i] = StageForward(fn, theta_args[s], h, s > 0 or job.input_gradient,
                                                     job.plan.remat[s])
                        h = records[s][i].outputs
                outs.append(h)
                if aux_spec:
                    aux_parts.append(micro_ctx.aux)
            with tf.device(job.devices[-1]):
                flat_outs = [tf.concat(parts, axis=0) for parts in zip(*[tf.nest.flatten(o) for o in outs])]
                if aux_spec:
                    output["aux"] = {path: tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)),
                                                                 *[part[path] for part in aux_parts])
                                     for path in aux_spec}
            output["structure"] = outs[0]

            def grad_fn(*upstream: tf.Tensor) -> list[Any]:
                out_is_float = [is_float(t) for t in tf.nest.flatten(outs[0])]
                with tf.device(job.devices[-1]):
                    float_upstream = [tf.split(g, m, axis=0) for g, f in zip(upstream, out_is_float) if f]
                # updates[s]: the last in-place additions into stage s's gradient sums.
                updates: list[list[Any] | None] = [None] * k
                input_grads = []
                for i in reversed(range(m)):
                    dy = [parts[i] for parts in float_upstream]
                    for s in reversed(range(k)):
                        with placement.on_stage(job.stage_scopes[s]):
                            # B(k, i) after B(k, i+1): one partial weight gradient per stage at a time.
                            dx, weight_grads = records[s][i].gradient(dy, after=updates[s] or [])
                            add = "assign" if updates[s] is None else "assign_add"  # the first needs no zeroing
                            updates[s] = [getattr(acc, add)(g, read_value=False)
                                          for acc, g in zip(gradient_sums[s], weight_grads)]
                            dy = dx
                    input_grads.append(dy)
                with tf.device(job.devices[0]):
                    if job.input_gradient:
                        dx = [tf.concat(parts[::-1], axis=0) for parts in zip(*input_grads)]
                    else:
                        dx = [tf.zeros_like(t) for t in flat_inputs]
                sums = []
                for s in range(k):
                    with tf.device(job.devices[s]), tf.control_dependencies(updates[s]):
                        sums += [acc.read_value() for acc in gradient_sums[s]]
                return dx + sums

            return flat_outs, grad_fn

        flat_out = pipeline(*flat_inputs, *[t for f in flat_theta for t in f])
        return tf.nest.pack_sequence_as(output["structure"], list(flat_out)), output.get("aux")
