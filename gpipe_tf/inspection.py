"""`--mode=inspect`: parameters and memory of a model, per pipeline stage, from Params alone.

Nothing is built: counts and shapes come from each layer's `num_params` and `output_spec` classmethods, so a
multi-billion-parameter configuration is inspected in seconds on any machine.

The stages are the pipeline's stage plan (`gpipe.plan.make_plan`, the function the GPipe layer itself calls), so
the split and the remat decisions shown are the ones training uses; an invalid pipeline configuration raises the
error training would. One plan cannot be made without building layers: balance_by='time' with no explicit balance
times each layer. Then the report lists no stages and its "note" says why (and how to see them), rather than
showing a split by another cost that training would not use. Devices are not resolved (the inspecting machine need
not have the run's devices).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.plan import StagePlan, TimingRequired, make_plan
from gpipe_tf.gpipe.schedules import virtual_stages
from gpipe_tf.hyperparams import InstantiableParams, Params
from gpipe_tf.layers.base_layer import BaseLayer


def count_params(p: InstantiableParams) -> int:
    """Trainable parameters of a layer or task: its own count, or the sum over its child layer Params."""
    try:
        return int(p.cls.num_params(p))
    except NotImplementedError:
        return sum(count_params(c) for c in _child_layers(p))


def _child_layers(p: Params) -> list[InstantiableParams]:
    out = []
    for _, value in p.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, InstantiableParams) and isinstance(item.cls, type) and issubclass(item.cls,
                                                                                                  BaseLayer):
                out.append(item)
    return out


def find_pipelines(p: Params, path: str = "task") -> list[tuple[str, InstantiableParams]]:
    """(path, Params) of every GPipe layer in a Params tree."""
    found = []
    if isinstance(p, InstantiableParams) and p.cls is GPipe:
        found.append((path, p))
    for name, value in p.items():
        for j, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, Params):
                found += find_pipelines(item, f"{path}.{name}" + (f"[{j}]" if isinstance(value, (list, tuple))
                                                                   else ""))
    return found


def _bytes(spec: Any) -> int:
    return sum(s.shape.num_elements() * s.dtype.size for s in tf.nest.flatten(spec))


def _layer_params(lp: InstantiableParams) -> int | None:
    """Trainable parameters of one pipeline layer from its Params, or None where it cannot count them."""
    try:
        return int(lp.cls.num_params(lp))
    except NotImplementedError:
        return None


def _stages(pipe: InstantiableParams, plan: StagePlan, path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Per-stage rows, and notes explaining every estimate that could not be made (shown as '-')."""
    layers = list(pipe.layers)
    notes = []
    if plan.cost_kind == "params":  # the plan counted them already: a deep model is counted once, not twice
        counts_all: list[int | None] = [int(c) for c in plan.layer_costs]
    else:
        counts_all = [_layer_params(lp) for lp in layers]
    uncounted = [j for j, c in enumerate(counts_all) if c is None]
    if uncounted:
        j = uncounted[0]
        notes.append(f"params '-': layer_{j} ({layers[j].cls.__name__})"
                     + (f" and {len(uncounted) - 1} more layers" if len(uncounted) > 1 else "")
                     + " cannot count their parameters from Params (no num_params); the total counts what it can")
    spec = None if pipe.micro_batch_shape is None else tf.TensorSpec(pipe.micro_batch_shape, pipe.input_dtype)
    if spec is None:
        notes.append(f"activations '-': {path}.micro_batch_shape is not set, so the shape of a micro-batch is "
                     "unknown (e.g. sequence models whose lengths vary by batch); to estimate, set it for the "
                     f"longest batch, e.g. --params={path}.micro_batch_shape=[B/M, T],{path}.input_dtype=int32")
    stage_costs = plan.stage_costs()
    stages = []
    for stage, names in enumerate(plan.stage_layers):
        indices = list(plan.layer_indices(stage))
        counts = [counts_all[j] for j in indices]
        entry: dict[str, Any] = {"stage": stage, "params": None if None in counts else sum(counts),
                                 "layers": list(names), "remat": plan.remat[stage],
                                 "cost": None if stage_costs is None else stage_costs[stage],
                                 "activation_bytes_estimate": None}
        if spec is not None:
            try:
                input_bytes, outputs = _bytes(spec), []
                for j in indices:
                    lp = layers[j]
                    failing = j
                    spec = lp.cls.output_spec(lp, spec)
                    outputs.append(_bytes(spec))
                m = pipe.num_micro_batches
                if plan.remat[stage]:
                    # Inputs of every micro-batch, plus one micro-batch's activations while it is recomputed.
                    entry["activation_bytes_estimate"] = m * input_bytes + sum(outputs)
                else:
                    entry["activation_bytes_estimate"] = m * sum(outputs)
            except NotImplementedError:
                spec = None
                notes.append(f"activations '-' from stage {stage} on: layer_{failing} "
                             f"({layers[failing].cls.__name__}) cannot infer its output shape from Params (no "
                             "output_spec), so the shapes after it are unknown")
        stages.append(entry)
    return stages, notes


_CRITERIA = {
    "params": "the contiguous split minimizing the largest stage's parameter count",
    "flops": "the contiguous split minimizing the largest stage's estimated forward flops",
    "time": "the contiguous split minimizing the largest stage's measured forward time",
}


def _balance_text(report: dict[str, Any]) -> str:
    if report["cost_kind"] is None:
        return f"balance: explicit balance={report['balance']}"
    costs = [s["cost"] for s in report["stages"]]
    show = (lambda c: f"{int(c):,}") if report["cost_kind"] == "params" else (lambda c: f"{c:.4g}")
    spread = f"; stage costs {show(min(costs))} .. {show(max(costs))}" if costs else ""
    return f"balance: balance_by='{report['cost_kind']}', {_CRITERIA[report['cost_kind']]}{spread}"


def inspect(params: Params, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"model", "total_params", "overrides", "pipeline": path or None, and for the first pipeline found:
    "num_micro_batches", "remat" (the policy), "balance", "cost_kind", "note", "estimate_notes", "stages":
    [{"stage", "params", "layers", "remat", "cost", "activation_bytes_estimate"}, ...]}.

    `overrides`: what the command changed (e.g. {"gin_param": [...], "params": "..."}), echoed in the report.
    Without a plan (see the module doc) "balance" is None, "stages" is empty and "note" says why; otherwise "note"
    is None. Stage "params" and "activation_bytes_estimate" are None where they cannot be computed from Params;
    "estimate_notes" then says why and how to get them."""
    total = count_params(params.task)
    pipelines = find_pipelines(params.task)
    report: dict[str, Any] = {"model": params.model, "total_params": total, "pipeline": None, "stages": [],
                              "overrides": {k: v for k, v in (overrides or {}).items() if v}}
    if pipelines:
        path, pipe = pipelines[0]
        report.update(pipeline=path, num_micro_batches=pipe.num_micro_batches, remat=pipe.remat, balance=None,
                      cost_kind=None, note=None, estimate_notes=[])
        try:
            plan = make_plan(pipe, virtual_stages=virtual_stages(pipe.schedule, pipe.num_stages, path),
                             num_replicas=None, measure=None, path=path)
        except TimingRequired as e:
            report["note"] = str(e)
            return report
        stages, notes = _stages(pipe, plan, path)
        report.update(balance=list(plan.balance), cost_kind=plan.cost_kind, stages=stages, estimate_notes=notes)
    return report


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:,.1f} GiB"


def format_report(report: dict[str, Any]) -> str:
    """The report as text: totals, then one line per stage."""
    lines = [f"model {report['model']}: {report['total_params']:,} trainable parameters "
             f"({_human(report['total_params'] * 4)} in float32)"]
    for name, value in report.get("overrides", {}).items():
        lines.append(f"overrides --{name}: " + (", ".join(value) if isinstance(value, (list, tuple)) else value))
    if report["stages"]:
        lines.append(f"pipeline {report['pipeline']}: K={len(report['stages'])} M={report['num_micro_batches']} "
                     f"remat={report['remat']}")
        lines.append(_balance_text(report))
        lines.append(f"{'stage':>5}  {'params':>16}  {'remat':<5}  {'activations (est.)':>18}  layers")
        for s in report["stages"]:
            act = s["activation_bytes_estimate"]
            act_text = "-" if act is None else _human(act)
            params_text = "-" if s["params"] is None else f"{s['params']:,}"
            span = f"{s['layers'][0]} .. {s['layers'][-1]}" if len(s["layers"]) > 1 else s["layers"][0]
            lines.append(f"{s['stage']:>5}  {params_text:>16}  {'yes' if s['remat'] else 'no':<5}  {act_text:>18}  "
                         f"{span}")
        lines += [f"note: {note}" for note in report["estimate_notes"]]
    elif report.get("note"):
        lines.append(f"pipeline {report['pipeline']}: no stages shown. {report['note']}")
    return "\n".join(lines)
