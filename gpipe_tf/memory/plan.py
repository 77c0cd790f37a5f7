"""The per-device memory plan of a pipeline: every device's weights, gradient sums, optimizer slots, stashes under
the schedule and remat policy, boundary buffers and predicted peak, against a device memory budget.

Everything comes from Params (`stage.py` says what a stage holds), so an 83.9B-parameter, 128-device plan takes
seconds. The stage split is the pipeline's own (`gpipe.plan.make_plan`), the stash counts the schedule's
(`stash.stashed_micro_batches`), the optimizer's slots the configured optimizer's (`optimizer_memory`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.plan import make_plan, micro_batch_spec
from gpipe_tf.gpipe.schedules import step_order
from gpipe_tf.hyperparams import InstantiableParams, Params
from gpipe_tf.memory import stage as stage_lib
from gpipe_tf.memory.head import NO_HEAD, Head, head_memory
from gpipe_tf.memory.stage import OptimizerMemory
from gpipe_tf.memory.stash import stashed_micro_batches


def optimizer_memory(optimizer: Params) -> OptimizerMemory:
    """By the optimizer's class name: SGD 0 slots (momentum: 1 slot, 1 early and 1 update temporary: momentum * v),
    RMSProp 1 slot (+1 centered, +1 momentum; decay * ms early; 2 at the update: it and lr * g / sqrt(ms)),
    Adam and AdamW 2 slots (b1 m and b2 v early; 3 at the update), Adafactor (factored) ~0 slots: its second moment
    is rows + columns of each matrix, under 1% of the weights for matrices wider than 200 (+1 with beta1 > 0;
    temporaries counted as RMSProp's)."""
    cls = getattr(optimizer, "cls", None)
    name = cls.__name__ if isinstance(cls, type) else str(optimizer.get("name") if "name" in optimizer else "")
    kind = name.lower()

    def field(key: str, default: Any = 0.0) -> Any:
        return optimizer.get(key) if key in optimizer else default

    if kind == "sgd":
        return OptimizerMemory(1.0, 1.0, 1.0) if field("momentum") else OptimizerMemory(0.0, 0.0, 0.0)
    if kind in ("adam", "adamw"):
        return OptimizerMemory(2.0, 2.0, 3.0)
    if kind == "rmsprop":
        extra = bool(field("centered", False))
        return OptimizerMemory(1.0 + extra + bool(field("momentum")), 1.0 + extra, 2.0 + extra)
    if kind == "adafactor":
        return OptimizerMemory(1.0 if field("beta1") else 0.0, 1.0, 2.0)
    raise ConfigError(f"memory plan: optimizer {name!r} has no memory model; known: SGD, Adam, AdamW, RMSProp, "
                      "Adafactor")


def schedule_order(pipe: InstantiableParams, path: str = "task.network") -> ScheduleOrder:
    """The order data of the schedule `pipe` (GPipe Params) runs, for its K devices: what its loop holds."""
    return step_order(pipe.schedule, pipe.num_stages, path)


def plan_pipeline(pipe: InstantiableParams, train: Params, path: str = "task.network",
                  device_memory: int | None = None, head: Head = NO_HEAD) -> dict[str, Any]:
    """The per-device plan of the GPipe layer `pipe` trained with `train` (its optimizer and EMA), with the task's
    loss `head` (`head.task_head`) on the device of the last chunk.

    Returns {"schedule", "num_devices", "num_micro_batches", "remat", "compute_dtype", "optimizer_slot_copies",
    "device_memory", "fits", "max_peak", "devices": [{"device", "stages", "weights", ..., "peak", "fits"}],
    "stages": [per pipeline stage: its StageMemory fields and "peak"]}. Raises ConfigError when the micro-batch
    shape is unknown or a layer cannot estimate its memory.
    """
    if pipe.micro_batch_shape is None:
        raise ConfigError(f"memory plan: {path}.micro_batch_shape is not set, so the activations cannot be sized; "
                          f"set it for the longest batch, e.g. --params={path}.micro_batch_shape=[B/M, T],"
                          f"{path}.input_dtype=int32")
    order = schedule_order(pipe, path)
    plan = make_plan(pipe, chunk_devices=order.devices_by_chunk, num_replicas=None, measure=None, path=path)
    k, m, v = plan.num_devices, pipe.num_micro_batches, order.virtual_stages
    stashes = stashed_micro_batches(order, m)
    var_dtype = tf.as_dtype(pipe.dtype or "float32")
    compute = tf.as_dtype(pipe.fprop_dtype or var_dtype.name)
    opt = optimizer_memory(train.optimizer)
    ema = bool(train.get("ema_decay")) if "ema_decay" in train else False
    spec = stage_lib.compute_spec(micro_batch_spec(pipe, path), compute.name)
    layers = list(pipe.layers)
    stages = []
    for s, names in enumerate(plan.stage_layers):
        indices = list(plan.layer_indices(s))
        traces = stage_lib.trace_layers([layers[j] for j in indices], spec, names)
        last = s == plan.num_chunks - 1
        # The head runs on each micro-batch's output where the schedule computes the loss per micro-batch, else once
        # on all M outputs.
        head_params, head_bytes = head_memory(head, traces[-1].output_spec, 1 if order.head_per_micro_batch else m
                                              ) if last else ((), 0)
        setting = stage_lib.StageSetting(
            micro_batches=m, stashed=stashes[s], remat=plan.remat[s], first=s == 0, last=last,
            kept_outputs=_kept_outputs(order, m, bool(head.layers)) if last else 2, input_gradient=s > 0,
            variable_bytes=var_dtype.size, compute_bytes=compute.size, optimizer=opt, ema=ema,
            head_params=head_params, head_bytes=head_bytes,
            head_before_backward=order.head_in_forward, weight_casts=_weight_casts(order, m, stashes[s]))
        stages.append((s, list(names), stage_lib.stage_memory(traces, spec, setting)))
        spec = traces[-1].output_spec
    devices = []
    per_stage = [{"stage": s, **mem.as_dict()} for s, _, mem in stages]
    for d in range(k):
        mine = [(s, names, mem) for s, names, mem in stages if order.device(s) == d]
        row: dict[str, Any] = {"device": d, "stages": [s for s, _, _ in mine],
                               "layers": [n for _, names, _ in mine for n in names]}
        for key in dataclasses.asdict(mine[0][2]):
            row[key] = sum(getattr(mem, key) for _, _, mem in mine)
        row["peak"] = stage_lib.device_peak([mem for _, _, mem in mine])  # not the sum of the chunks' peaks
        row["fits"] = None if device_memory is None else row["peak"] <= device_memory
        devices.append(row)
    fits = None if device_memory is None else all(r["fits"] for r in devices)
    return {"schedule": order.name, "num_devices": k, "virtual_stages": v, "num_micro_batches": m,
            "remat": pipe.remat, "compute_dtype": compute.name, "optimizer_slot_copies": opt.slots, "ema": ema,
            "device_memory": device_memory, "fits": fits, "devices": devices, "stages": per_stage,
            "head": [name for name, _ in head.layers],
            "max_peak": max(r["peak"] for r in devices)}


def _kept_outputs(order: ScheduleOrder, num_micro_batches: int, has_head: bool) -> int:
    """The output-sized tensors the last stage holds at its peak under `order` (`StageSetting.kept_outputs`); a
    pipeline with no planned head (its caller runs the loss on the whole output) keeps every output and gradient."""
    if order.loss_per_micro_batch:
        return 2
    return num_micro_batches + 1 if order.head_in_forward and has_head else 2 * num_micro_batches


def _weight_casts(order: ScheduleOrder, num_micro_batches: int, stashed: int) -> int:
    """Micro-batches whose cast of a stage's weights (mixed precision) the stage holds at its peak
    (`StageSetting.weight_casts`): every one in a windowed loop (it casts as it starts: a cast waits for no
    window), one where the schedule is one graph without a loop (unrolled: TensorFlow merges identical casts), else
    the stashed ones (fill-drain's loop keeps each iteration's for its backward)."""
    if order.loss_per_micro_batch:
        return num_micro_batches
    return stashed if order.head_per_micro_batch else 1
