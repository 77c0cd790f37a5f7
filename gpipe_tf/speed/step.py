"""The predicted time of one training step of a pipeline on an accelerator, from Params alone.

Each cell of the schedule's order (`timeline.predict`, the simulation that draws `--timeline` predictions) costs:

* forward F(c, i): chunk c's forward flops (`costs.chunk_work`) at the device's achieved FLOP/s in the compute
  dtype, plus sending its output to the next chunk (`Accelerator.transfer_seconds`);
* backward B(c, i): twice the forward flops (an input-gradient and a weight-gradient matmul per forward matmul),
  the forward again where the chunk recomputes it (remat), sending the input gradient back, and, with M > 1, adding
  the micro-batch's weight gradients to the sums (memory-bound: read the sum and the gradient, write the sum);
  a zero-bubble order's W cell is the weight-gradient half and the sums.

A transfer is charged to the sending device's cell (none between neighbouring chunks on one device): a device that
overlaps sending with compute does better. Each device then runs the optimizer's update, memory-bound, from the end
of its own last cell: it reads its weights, gradient sums and optimizer slots and writes the weights and slots back
(`memory.plan.optimizer_memory` counts the slots). The step ends with the last device's update.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe.batch_shapes import batch_rows
from gpipe_tf.gpipe.plan import make_plan
from gpipe_tf.gpipe.timeline import predict
from gpipe_tf.hyperparams import InstantiableParams, Params
from gpipe_tf.memory.head import NO_HEAD, Head
from gpipe_tf.memory.plan import optimizer_memory, schedule_order
from gpipe_tf.speed.accelerators import Accelerator
from gpipe_tf.speed.costs import chunk_work

_TINY = 1e-12  # seconds: the simulation needs positive cell costs


def compute_dtype(pipe: InstantiableParams) -> str:
    """The dtype the pipeline computes in, as the memory plan reads it: fprop_dtype, else the variables' dtype."""
    return tf.as_dtype(pipe.fprop_dtype or pipe.dtype or "float32").name


def predict_step(pipe: InstantiableParams, train: Params, device: Accelerator, head: Head = NO_HEAD,
                 path: str = "task.network") -> dict[str, Any]:
    """The predicted step of the GPipe Params `pipe` trained with `train` (its optimizer) on `device` (see the
    module doc): {"schedule", "num_stages", "num_micro_batches", "remat", "compute_dtype", "batch",
    "step_seconds", "pipeline_seconds" (the simulated makespan), "update_seconds" (what the updates add to it),
    "bubble",
    "examples_per_second", "step_flops", "chunk_seconds" (each chunk's forward and backward of one micro-batch)}.

    Raises ParamsError or ConfigError where the plan cannot be made or a layer cannot say its flops."""
    order = schedule_order(pipe, path)
    plan = make_plan(pipe, chunk_devices=order.devices_by_chunk, num_replicas=None, measure=None, path=path)
    m = pipe.num_micro_batches
    order.check_micro_batches(m, path)
    dtype = compute_dtype(pipe)
    work = chunk_work(pipe, plan, dtype, head, path)
    rate = device.flops_per_second(dtype)
    variable_bytes = tf.as_dtype(pipe.dtype or "float32").size
    forward, backward, weights = [], [], []
    for c, w in enumerate(work):
        compute = w.forward_flops / rate
        sums = 3 * w.params * variable_bytes / device.memory_bandwidth if m > 1 else 0.0
        # Neighbouring chunks on one device (a V's turn) hand their tensors over without a transfer.
        sends = 0 < c + 1 < len(work) and order.device(c + 1) != order.device(c)
        returns = c > 0 and order.device(c - 1) != order.device(c)
        forward.append(max(_TINY, compute + (device.transfer_seconds(w.output_bytes) if sends else 0.0)))
        weights.append(compute + sums)
        backward.append(max(_TINY, 2 * compute + (compute if plan.remat[c] else 0.0) + sums
                            + (device.transfer_seconds(w.input_bytes) if returns else 0.0)))
    share = min(0.99, max(0.01, sum(weights) / sum(backward)))
    timeline = predict(order, m, stage_costs=forward, backward_costs=backward, weight_fraction=share)
    slots = optimizer_memory(train.optimizer).slots
    held = [0] * plan.num_devices
    for c, w in enumerate(work):
        held[order.device(c)] += w.params
    updates = [n * variable_bytes * (3 + 2 * slots) / device.memory_bandwidth for n in held]
    # A device updates its weights once its own last cell has ended, beside the others' remaining cells.
    ends = [max(cell.end for cell in timeline.cells if cell.stage == d) for d in range(plan.num_devices)]
    step = max(end + update for end, update in zip(ends, updates))
    update = step - timeline.makespan
    batch = batch_rows(pipe.micro_batch_shape, m)
    return {"schedule": order.name, "num_stages": plan.num_devices, "num_micro_batches": m, "remat": pipe.remat,
            "compute_dtype": dtype, "batch": batch, "step_seconds": step, "pipeline_seconds": timeline.makespan,
            "update_seconds": update, "bubble": timeline.bubble_fraction, "examples_per_second": batch / step,
            "step_flops": m * sum(3 * w.forward_flops for w in work),
            "chunk_seconds": [(f, b) for f, b in zip(forward, backward)]}
