"""The largest model that fits: for each number of pipeline stages K, the largest value of one integer knob of an
experiment (AmoebaNet-D's filters or cells per stack, a Transformer's layers) whose memory plan fits every device.

The planner (`plan.plan_pipeline`) is asked by bisection, so a search over a thousand-layer range plans about ten
models per K; a model grows monotonically with the knob, so the first value that does not fit bounds the search.
A knob that sets the training batch size is searched over the batch sizes the trainer accepts only (`batch_multiple`).
The experiment is resolved as the trainer resolves it (gin bindings, then dotted overrides), with the knob and
`num_stages` bound as gin knobs: resolving experiments puts this module above `experiment.py`, on the floor below
the trainer's (docs/layout.md#floors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from gpipe_tf import experiment, model_registry
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.pipeline import find_pipelines
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.layers.base_layer import count_params
from gpipe_tf.memory.head import task_head
from gpipe_tf.memory.plan import plan_pipeline
from gpipe_tf.memory.sizes import human
from gpipe_tf.speed.search import stage_counts


def largest(fits: Callable[[int], bool], low: int, high: int, step: int = 1) -> int | None:
    """The largest n >= low (a multiple of `step`) with fits(n), fits being monotone (true up to some n, then
    false); `high` is the first guess of the upper end, doubled while it still fits. None if `low` does not fit."""
    if not fits(low):
        return None
    lo, hi = low // step, max(high // step, low // step + 1)
    while fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def _check_knob(model: str, knob: str) -> int:
    """The default of integer knob `knob` of registered `model`; ConfigError naming the integer knobs otherwise."""
    knobs = model_registry.get(model).knobs()
    if "num_stages" not in knobs:
        raise ConfigError(f"capacity: {model} has no num_stages knob, so K cannot be varied; pick a pipelined "
                          "experiment")
    integers = sorted(name for name, value in knobs.items() if isinstance(value, int) and not isinstance(value, bool)
                      and name != "num_stages")
    if knob not in integers:
        raise ConfigError(f"capacity: {knob!r} is not an integer knob of {model}; grow one of: "
                          f"{', '.join(integers)}")
    return knobs[knob]


def batch_multiple(params: Params) -> tuple[int, str]:
    """The training batch sizes the trainer accepts are the multiples of the first value; the second says why.

    The trainer gives each of the train.num_replicas (R) replicas an equal slice of the batch (the controller refuses
    a batch R does not divide) and each pipeline splits its slice into its num_micro_batches (M) micro-batches
    (`microbatch.check_divisible` refuses a slice that M does not divide): the batch is a multiple of R x lcm(M).
    """
    replicas = int(params.train.get("num_replicas") or 1)
    counts = sorted({pipe.num_micro_batches for _, pipe in find_pipelines(params.task)})
    parts = ([f"num_micro_batches={'/'.join(map(str, counts))}"] if math.lcm(*counts) > 1 else []) + (
        [f"{replicas} replicas"] if replicas > 1 else [])
    return replicas * math.lcm(*counts), " x ".join(parts)


def search_step(model: str, knob: str, default: int, num_stages: int, step: int, gin_bindings: Sequence[str] = (),
                overrides: str = "", gin_files: Sequence[str] = ()) -> tuple[int, str]:
    """The step of the values of `knob` to try on `num_stages` stages, and a note: `step`, or when the knob sets
    input.train.batch_size (it does at its default and at twice it), the least multiple of `step` that is a batch
    size the trainer accepts (`batch_multiple`), with a note naming it."""
    first = None
    for value in (default, 2 * default):
        params, _ = experiment.resolve_params(
            model, gin_files=gin_files, overrides=overrides,
            gin_bindings=[*gin_bindings, f"{model}.{knob}={value}", f"{model}.num_stages={num_stages}"])
        if value < 1 or params.input.train.batch_size != value:
            return step, ""
        first = params if first is None else first
    multiple, why = batch_multiple(first)
    lcm = math.lcm(step, multiple)
    return lcm, "" if lcm == step else f"multiples of {lcm}: batch sizes the trainer accepts ({why})"


def plan_with(model: str, knob: str, value: int, num_stages: int, device_memory: int,
              gin_bindings: Sequence[str] = (), overrides: str = "", gin_files: Sequence[str] = ()) -> dict[str, Any]:
    """The memory plan of `model` with `knob`=`value` on `num_stages` stages against `device_memory`, plus
    "params" (its parameter count). Raises ConfigError when it has no pipeline or cannot be planned."""
    params, _ = experiment.resolve_params(
        model, gin_files=gin_files, overrides=overrides,
        gin_bindings=[*gin_bindings, f"{model}.{knob}={value}", f"{model}.num_stages={num_stages}"])
    pipelines = find_pipelines(params.task)
    if not pipelines:
        raise ConfigError(f"capacity: {model} with num_stages={num_stages} builds no pipeline to plan (an experiment "
                          "may build a plain stack for one stage and one micro-batch); start at 2 stages or give "
                          "it more micro-batches")
    path, pipe = pipelines[0]
    plan = plan_pipeline(pipe, params.train, path, device_memory, head=task_head(params.task, path))
    plan["params"] = count_params(params.task)
    return plan


def capacity(model: str, knob: str, device_memory: int, max_devices: int, gin_bindings: Sequence[str] = (),
             overrides: str = "", step: int = 1, progress: Callable[[str], None] | None = None,
             gin_files: Sequence[str] = ()) -> list[dict[str, Any]]:
    """For each K of `stage_counts(max_devices)`: {"num_stages", "value" (the largest knob value that fits, None if
    even `step` does not), "params", "max_peak", "note"}. A K whose model cannot be planned has value None and a
    note saying why. A knob that sets the batch size takes only values the trainer accepts (`search_step`)."""
    default = _check_knob(model, knob)
    rows = []
    for k in stage_counts(max_devices):
        k_step, step_note = search_step(model, knob, default, k, step, gin_bindings, overrides, gin_files)
        plans: dict[int, dict[str, Any]] = {}  # each value is planned once: the search revisits its ends

        def plan(value: int, k: int = k, plans: dict[int, dict[str, Any]] = plans) -> dict[str, Any]:
            if value not in plans:
                plans[value] = plan_with(model, knob, value, k, device_memory, gin_bindings, overrides, gin_files)
            return plans[value]

        row: dict[str, Any] = {"num_stages": k, "value": None, "params": None, "max_peak": None, "note": step_note}
        # The smallest value K stages can split (a model of 2 layers has no 4-stage split): doubled from `k_step`.
        low, error = k_step, None
        while low <= max(default, k_step) * 2 ** 10:
            try:
                plan(low)
                error = None
                break
            except (ConfigError, ParamsError, ValueError) as e:
                low, error = low * 2, e
        best = None if error is not None else largest(lambda value: bool(plan(value)["fits"]), low,
                                                      max(default, low), k_step)
        if error is not None:
            row["note"] = " ".join(str(error).split())
        elif best is None:
            row["note"] = f"{knob}={low} does not fit"
            row["note"] += f"; {step_note}" if step_note else ""
        else:
            row.update(value=best, params=plans[best]["params"], max_peak=plans[best]["max_peak"])
        rows.append(row)
        if progress is not None:
            progress(f"K={k}: {knob}={row['value']}")
    return rows


def format_capacity(model: str, knob: str, device_memory_text: str, rows: list[dict[str, Any]]) -> str:
    """The capacity table as text, one row per K."""
    lines = [f"largest {knob} of {model} that fits {device_memory_text} per device (memory planner):",
             f"{'K':>4}  {knob:>16}  {'params':>16}  {'largest peak':>12}  note"]
    for row in rows:
        value = "-" if row["value"] is None else f"{row['value']:,}"
        params = "-" if row["params"] is None else f"{row['params']:,}"
        peak = "-" if row["max_peak"] is None else human(row["max_peak"])
        lines.append(f"{row['num_stages']:>4}  {value:>16}  {params:>16}  {peak:>12}  {row['note']}".rstrip())
    return "\n".join(lines)
