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


def _stages(pipe: InstantiableParams, plan: StagePlan) -> list[dict[str, Any]]:
    layers = list(pipe.layers)
    spec = None if pipe.micro_batch_shape is None else tf.TensorSpec(pipe.micro_batch_shape, pipe.input_dtype)
    stage_costs = plan.stage_costs()
    stages = []
    for stage, names in enumerate(plan.stage_layers):
        stage_layers = [layers[j] for j in plan.layer_indices(stage)]
        counts = [_layer_params(lp) for lp in stage_layers]
        entry: dict[str, Any] = {"stage": stage, "params": None if None in counts else sum(counts),
                                 "layers": list(names), "remat": plan.remat[stage],
                                 "cost": None if stage_costs is None else stage_costs[stage],
                                 "activation_bytes_estimate": None}
        if spec is not None:
            try:
                input_bytes, outputs = _bytes(spec), []
                for lp in stage_layers:
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
        stages.append(entry)
    return stages


def inspect(params: Params) -> dict[str, Any]:
    """{"model", "total_params", "pipeline": path or None, and for the first pipeline found: "num_micro_batches",
    "remat" (the policy), "balance", "cost_kind", "note", "stages": [{"stage", "params", "layers", "remat", "cost",
    "activation_bytes_estimate"}, ...]}. Without a plan (see the module doc) "balance" is None, "stages" is empty
    and "note" says why; otherwise "note" is None. Stage "params" is None where a layer cannot count its own."""
    total = count_params(params.task)
    pipelines = find_pipelines(params.task)
    report: dict[str, Any] = {"model": params.model, "total_params": total, "pipeline": None, "stages": []}
    if pipelines:
        path, pipe = pipelines[0]
        report.update(pipeline=path, num_micro_batches=pipe.num_micro_batches, remat=pipe.remat, balance=None,
                      cost_kind=None, note=None)
        try:
            plan = make_plan(pipe, num_replicas=None, measure=None, path=path)
        except TimingRequired as e:
            report["note"] = str(e)
            return report
        report.update(balance=list(plan.balance), cost_kind=plan.cost_kind, stages=_stages(pipe, plan))
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
    if report["stages"]:
        balanced = "explicit balance" if report["cost_kind"] is None else f"balanced by {report['cost_kind']}"
        lines.append(f"pipeline {report['pipeline']}: K={len(report['stages'])} M={report['num_micro_batches']} "
                     f"remat={report['remat']}, {balanced}")
        lines.append(f"{'stage':>5}  {'params':>16}  {'remat':<5}  {'activations (est.)':>18}  layers")
        for s in report["stages"]:
            act = s["activation_bytes_estimate"]
            act_text = "-" if act is None else _human(act)
            params_text = "-" if s["params"] is None else f"{s['params']:,}"
            span = f"{s['layers'][0]} .. {s['layers'][-1]}" if len(s["layers"]) > 1 else s["layers"][0]
            lines.append(f"{s['stage']:>5}  {params_text:>16}  {'yes' if s['remat'] else 'no':<5}  {act_text:>18}  "
                         f"{span}")
    elif report.get("note"):
        lines.append(f"pipeline {report['pipeline']}: no stages shown. {report['note']}")
    return "\n".join(lines)
