"""Which K, M, schedule and remat to run: every configuration worth trying on N devices, each with its predicted
step (`step.predict_step`) and its memory plan (`memory.plan.plan_pipeline`), the fastest that fits first.

The candidates keep the experiment's model, batch, optimizer and precision and vary what a user can change with
one override each: K (1, 2, 4, ... up to N, and N), M (every power of two that divides the batch), the schedule
(`SEARCH_SCHEDULES`) and remat ('never', 'always' and the experiment's own policy). A configuration the pipeline
refuses (more chunks than layers, an M the schedule does not take) is left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.batch_shapes import batch_rows, rescaled_micro_batch_shape
from gpipe_tf.gpipe.schedules import SCHEDULES
from gpipe_tf.hyperparams import InstantiableParams, Params, ParamsError
from gpipe_tf.layers import estimates
from gpipe_tf.memory.head import NO_HEAD, Head
from gpipe_tf.memory.plan import plan_pipeline
from gpipe_tf.memory.sizes import human
from gpipe_tf.speed.accelerators import Accelerator
from gpipe_tf.speed.step import predict_step

# The schedules a search tries: one of each order ('unrolled' and 'spmd' run fill-drain's order, as fill_drain).
SEARCH_SCHEDULES = ("fill_drain", "one_f_one_b", "interleaved", "zero_bubble", "zero_bubble_v")
MAX_MICRO_BATCHES = 64


def stage_counts(max_devices: int) -> list[int]:
    """1, 2, 4, ... up to `max_devices`, and `max_devices` itself; a ConfigError below 1 device."""
    if max_devices < 1:
        raise ConfigError(f"{max_devices} devices; give at least 1")
    counts = [1]
    while counts[-1] * 2 <= max_devices:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == max_devices else counts + [max_devices]


def _schedule_name(pipe: InstantiableParams) -> str:
    value = pipe.schedule
    if isinstance(value, str):
        return value
    return next((name for name, cls in SCHEDULES.items() if value.cls is cls), value.cls.__name__)


def candidates(pipe: InstantiableParams, num_devices: int) -> list[dict[str, Any]]:
    """The changes to try (see the module doc): {"num_stages", "num_micro_batches", "schedule", "remat"} each, the
    pipeline's own configuration first."""
    batch = batch_rows(pipe.micro_batch_shape, pipe.num_micro_batches)
    counts = [2 ** j for j in range(int(math.log2(min(batch, MAX_MICRO_BATCHES))) + 1) if batch % 2 ** j == 0]
    own = {"num_stages": pipe.num_stages, "num_micro_batches": pipe.num_micro_batches,
           "schedule": _schedule_name(pipe), "remat": pipe.remat}
    out = [own]
    for k in stage_counts(num_devices):
        for schedule in SEARCH_SCHEDULES:
            for m in counts:
                for remat in dict.fromkeys(("never", "always", pipe.remat)):
                    change = {"num_stages": k, "num_micro_batches": m, "schedule": schedule, "remat": remat}
                    if change != own:
                        out.append(change)
    return out


def changed_fields(pipe: InstantiableParams, change: dict[str, Any]) -> dict[str, Any]:
    """The GPipe fields that make `change` of `pipe`, those that differ from it only: the batch kept (the
    micro-batch shape follows M), the balance recomputed by balance_by where K or the schedule changes (by flops
    where it is 'time': timing builds layers), the schedule's own Params kept where it is the same."""
    m = change["num_micro_batches"]
    shape = rescaled_micro_batch_shape(pipe.micro_batch_shape, pipe.num_micro_batches, m)
    if shape is None:
        raise ConfigError(f"num_micro_batches={m} does not divide the batch of "
                          f"{batch_rows(pipe.micro_batch_shape, pipe.num_micro_batches)}")
    fields: dict[str, Any] = {"num_stages": change["num_stages"], "num_micro_batches": m, "micro_batch_shape": shape,
                              "remat": change["remat"]}
    if change["schedule"] != _schedule_name(pipe):
        fields["schedule"] = change["schedule"]
    if "schedule" in fields or change["num_stages"] != pipe.num_stages:
        fields["balance"] = None
        if pipe.balance_by == "time":
            fields["balance_by"] = "flops"
    return {key: value for key, value in fields.items() if value != pipe.get(key)}


def apply(pipe: InstantiableParams, fields: dict[str, Any]) -> InstantiableParams:
    """A copy of `pipe` with `fields` (`changed_fields`) set; its layer Params are `pipe`'s own objects, which
    `estimates.memoized` knows by identity."""
    new = pipe.copy()
    new.layers = pipe.layers
    return new.set(**fields)


def override_text(fields: dict[str, Any], path: str) -> str:
    """The --params text that sets `fields` on the pipeline at `path`."""
    return ",".join(f"{path}.{key}={value!r}" for key, value in fields.items())


def speed_plan(pipe: InstantiableParams, train: Params, device: Accelerator, num_devices: int,
               device_memory: int | None = None, head: Head = NO_HEAD, path: str = "task.network",
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every candidate's prediction and memory plan, fastest first: {"accelerator", "num_devices",
    "device_memory", "current" (the pipeline's own configuration, or None where it cannot be predicted),
    "fastest" (the fastest that fits, or None), "rows": [{the change, "params" (its --params text), the
    prediction (`predict_step`), "max_peak", "fits"}], "skipped": how many candidates the pipeline refuses}.

    `device_memory` defaults to the device's memory."""
    if pipe.micro_batch_shape is None:
        raise ConfigError(f"speed plan: {path}.micro_batch_shape is not set, so the flops per micro-batch are "
                          f"unknown; set it, e.g. --params={path}.micro_batch_shape=[B/M, T],{path}.input_dtype=int32")
    budget = device.memory_bytes if device_memory is None else device_memory
    rows, skipped, current = [], 0, None
    changes = candidates(pipe, num_devices)
    with estimates.memoized():
        for j, change in enumerate(changes):
            try:
                fields = changed_fields(pipe, change)
                candidate = apply(pipe, fields)
                row = {**change, **predict_step(candidate, train, device, head, path)}
                memory = plan_pipeline(candidate, train, path, budget, head=head)
            except (ConfigError, ParamsError, ValueError):
                if j == 0:
                    raise
                skipped += 1
                continue
            row.update(max_peak=memory["max_peak"], fits=bool(memory["fits"]), params=override_text(fields, path))
            if j == 0:
                current = row
            rows.append(row)
            if progress is not None and (j + 1) % 50 == 0:
                progress(f"planned {j + 1} of {len(changes)} configurations")
    rows.sort(key=lambda r: (not r["fits"], r["step_seconds"]))
    fastest = rows[0] if rows and rows[0]["fits"] else None
    return {"accelerator": device.name, "device": device.describe(), "num_devices": num_devices,
            "device_memory": budget, "current": current, "fastest": fastest, "rows": rows, "skipped": skipped}


def schedule_bests(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{schedule: its fastest row that fits}, for the schedules with one that fits, in `SEARCH_SCHEDULES` order."""
    best: dict[str, dict[str, Any]] = {}
    for row in plan["rows"]:  # fastest first
        if row["fits"] and row["schedule"] not in best:
            best[row["schedule"]] = row
    return {name: best[name] for name in SEARCH_SCHEDULES if name in best}


def _seconds(value: float) -> str:
    return f"{value * 1e3:,.1f} ms" if value < 1 else f"{value:,.2f} s"


def format_speed_plan(plan: dict[str, Any], top: int = 10) -> list[str]:
    """The speed plan as text: the device, the table of the `top` fastest that fit, the current configuration
    and the fastest with the override that selects it."""
    rows = [r for r in plan["rows"] if r["fits"]][:top]
    current = plan["current"]
    lines = [f"speed plan on {plan['num_devices']} x {plan['device']}",
             f"budget {human(plan['device_memory'])} per device; {len(plan['rows'])} configurations planned, "
             f"{sum(r['fits'] for r in plan['rows'])} fit ({plan['skipped']} the pipeline refuses)",
             f"{'':2}{'K':>3} {'M':>3}  {'schedule':<14} {'remat':<12} {'step':>10} {'examples/s':>11} "
             f"{'bubble':>7} {'peak':>10}  fits"]

    def line(r: dict[str, Any], mark: str) -> str:
        return (f"{mark:2}{r['num_stages']:>3} {r['num_micro_batches']:>3}  {r['schedule']:<14} {r['remat']:<12} "
                f"{_seconds(r['step_seconds']):>10} {r['examples_per_second']:>11,.1f} {r['bubble']:>7.1%} "
                f"{human(r['max_peak']):>10}  {'yes' if r['fits'] else 'NO'}")

    lines += [line(r, "*" if r is current else "") for r in rows]
    if current is not None and current not in rows:
        lines.append(line(current, "*"))
    lines.append("* the experiment's own configuration; step = the simulated pipeline + the optimizer's update")
    best = schedule_bests(plan)
    if best:
        base = best["fill_drain"]["step_seconds"] if "fill_drain" in best else None
        lines.append("fastest that fits per schedule" + (", speed-up over fill_drain's" if base else "") + ": "
                     + ", ".join(f"{name} {_seconds(r['step_seconds'])}"
                                 + (f" ({base / r['step_seconds']:.2f}x)" if base else "") for name, r in best.items())
                     + ("" if base else "; no fill_drain configuration fits"))
    fastest = plan["fastest"]
    if fastest is None:
        lines.append("no configuration fits: more devices, bfloat16 or a smaller model")
    elif fastest is current:
        lines.append("fastest that fits: the experiment's own configuration")
    else:
        gain = "" if current is None else f", {current['step_seconds'] / fastest['step_seconds']:.2f}x the current"
        lines.append(f"fastest that fits: K={fastest['num_stages']} M={fastest['num_micro_batches']} "
                     f"{fastest['schedule']} remat={fastest['remat']} ({_seconds(fastest['step_seconds'])}{gain}): "
                     f"--params={fastest['params']}")
    return lines
