"""Writes what a run's pipelines look like: partition table and predicted schedule, as files and summaries.

Everything shown comes from each pipeline's stage plan (`GPipe.plan`, the split and remat decisions training uses).
For every GPipe layer in the task: `logdir/partition.txt` (stage, layers, params, remat, device, cost),
`logdir/timeline.txt` and `logdir/timeline.png` (the predicted timeline with its bubble fraction),
and the same as TensorBoard text and image summaries in `logdir/train`; the partition text there also shows the
per-device memory plan (`gpipe_tf/memory`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe import orders, timeline
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.plan import StagePlan
from gpipe_tf.gpipe.schedules import schedule_name
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.inspection import format_memory
from gpipe_tf.memory.head import NO_HEAD, task_head
from gpipe_tf.memory.plan import plan_pipeline
from gpipe_tf.training import timeline_pictures
from gpipe_tf.training.summaries import SummaryWriter


def pipelines(module: tf.Module) -> list[GPipe]:
    """Every GPipe layer inside `module` (itself included)."""
    found = [module] if isinstance(module, GPipe) else []
    return found + [m for m in module.submodules if isinstance(m, GPipe)]


def predicted_timeline(plan: StagePlan, num_micro_batches: int,
                       order: ScheduleOrder | None = None) -> timeline.Timeline:
    """The timeline of a schedule's order (`Schedule.step_order(K)`; None: fill-drain) predicted from a stage plan:
    its per-stage costs (equal stages where an explicit balance computed none) and its per-stage remat decisions.

    The plan has one entry per chunk of the order, K * v of them in pipeline order (on the devices the order gives,
    `ScheduleOrder.devices_by_chunk`), and the timeline has K rows.
    """
    if order is None:
        order = orders.fill_drain(plan.num_chunks)
    if order.num_chunks != plan.num_chunks:
        raise ParamsError(f"the {order.name} order has {order.num_chunks} chunks (K={order.num_devices} x "
                          f"v={order.virtual_stages}) but the plan has {plan.num_chunks}: plan with "
                          f"virtual_stages={order.virtual_stages}, or pass the order of the schedule the plan is for")
    costs = plan.stage_costs()
    if costs is not None:
        costs = [max(c, 1e-12) for c in costs]
        total = sum(costs)
        costs = [c / total for c in costs]
    return timeline.predict(order, num_micro_batches, costs, remat=list(plan.remat))


def shared_device_warnings(task: tf.Module) -> list[str]:
    """One warning per pipeline whose stages (of any replica) share a device, naming the stages and the device.

    Placement goes round-robin when there are fewer devices than stages (e.g. --logical_devices=1 with K=3): the
    result is still correct, but stages on one device run one after another instead of as a pipeline.
    """
    warnings = []
    for pipe in pipelines(task):
        num_replicas = len(pipe.replica_devices)
        holders: dict[str, list[str]] = {}
        for r, devices in enumerate(pipe.replica_devices):
            for k, device in enumerate(devices):
                holders.setdefault(device, []).append(f"replica {r} stage {k}" if num_replicas > 1 else str(k))
        # The Interleaved and ZeroBubbleV schedules put v chunks on each device on purpose.
        per_device = pipe.plan.virtual_stages
        shared = {device: names for device, names in holders.items() if len(names) > per_device}
        if not shared:
            continue
        needed = num_replicas * pipe.p.num_stages
        listing = "; ".join(f"{'' if num_replicas > 1 else 'stages '}{', '.join(names)} share {device}"
                            for device, names in shared.items())
        plural = "s" if len(holders) > 1 else ""
        warnings.append(f"warning: {pipe.path} places {needed} stages on {len(holders)} device{plural}: {listing}. "
                        "Results are the same, but stages sharing a device run one after another, not as a pipeline; "
                        f"give each stage its own device (on a CPU: --logical_devices={needed}) or lower num_stages")
    return warnings


def memory_text(pipe: GPipe, train_params: Params | None, task: tf.Module | None = None) -> str:
    """The pipeline's per-device memory plan as text (`memory.plan`), with `task`'s loss head if `pipe` is its
    network, or one line saying why there is none."""
    if train_params is None:
        return "memory: no plan (the training Params were not given)"
    head = task_head(task.p, "task.network") if task is not None and getattr(task, "network", None) is pipe else NO_HEAD
    try:
        return "\n".join(format_memory(plan_pipeline(pipe.p, train_params, pipe.path, head=head)))
    except ConfigError as e:
        return f"memory: no plan: {e}"


def write(task: tf.Module, logdir: str, writer: SummaryWriter, step: int, log: Callable[[str], None],
          train_params: Params | None = None) -> None:
    """Writes the partition table and the predicted timeline picture of each pipeline; logs the table. TensorBoard's
    partition text also shows each pipeline's per-device memory plan (from `train_params`' optimizer)."""
    pipes = pipelines(task)
    if not pipes:
        return
    tables, texts, memories = [], [], []
    for pipe in pipes:
        memories.append(memory_text(pipe, train_params, task))
        predicted = predicted_timeline(pipe.plan, pipe.p.num_micro_batches,
                                       pipe.schedule.step_order(pipe.plan.num_devices))
        schedule = schedule_name(pipe.p.schedule)  # one name for the table and the picture
        tables.append(f"# {pipe.path}: K={pipe.p.num_stages} M={pipe.p.num_micro_batches} remat={pipe.p.remat} "
                      f"schedule={schedule}\n" + pipe.partition_table())
        texts.append(f"# {pipe.path}\n" + timeline_pictures.render_text(predicted))
        png_name = "timeline.png" if len(pipes) == 1 else f"timeline_{pipe.path.replace('/', '.')}.png"
        with open(os.path.join(logdir, png_name), "wb") as f:
            f.write(timeline_pictures.render_png(predicted, schedule=schedule))
        writer.image(step, f"pipeline_timeline/{pipe.path}",
                     timeline_pictures.image_tensor(predicted, schedule=schedule))
    table_text, timeline_text = "\n\n".join(tables), "\n\n".join(texts)
    for name, text in (("partition.txt", table_text), ("timeline.txt", timeline_text)):
        with open(os.path.join(logdir, name), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    writer.text(step, "partition", "\n\n".join(f"{table}\n\n{memory}" for table, memory in zip(tables, memories)))
    writer.text(step, "pipeline_timeline", timeline_text)
    log(table_text)
