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

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.pipeline import find_pipelines
from gpipe_tf.gpipe.plan import StagePlan, TimingRequiredError, make_plan
from gpipe_tf.gpipe.schedules import step_order
from gpipe_tf.hyperparams import InstantiableParams, Params
from gpipe_tf.layers.base_layer import count_params
from gpipe_tf.memory import plan as memory_plan
from gpipe_tf.memory import suggest
from gpipe_tf.memory.head import task_head
from gpipe_tf.memory.sizes import human


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
    stage_costs = plan.stage_costs()
    stages = []
    for stage, names in enumerate(plan.stage_layers):
        indices = list(plan.layer_indices(stage))
        counts = [counts_all[j] for j in indices]
        entry: dict[str, Any] = {"stage": stage, "params": None if None in counts else sum(counts),
                                 "layers": list(names), "remat": plan.remat[stage],
                                 "cost": None if stage_costs is None else stage_costs[stage],
                                 "activation_bytes_estimate": None}
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


def _memory(params: Params, pipe: InstantiableParams, path: str, stages: list[dict[str, Any]], notes: list[str],
            device_memory: int | None) -> dict[str, Any] | None:
    """The per-device memory plan (and, where it does not fit, the smallest change that does), or None with a
    note saying why it cannot be made. With `device_memory` set, that reason is an error (ConfigError)."""
    try:
        if "train" not in params:
            raise ConfigError("memory plan: these Params have no train subtree, so the optimizer is unknown")
        head = task_head(params.task, path)
        plan = memory_plan.plan_pipeline(pipe, params.train, path, device_memory, head=head)
    except ConfigError as e:
        if device_memory is not None:
            raise
        notes.append(f"activations and memory '-': {e}")
        return None
    for entry, mem in zip(stages, plan["stages"]):
        entry["activation_bytes_estimate"] = mem["stashed_activations"] + mem["recompute"]
    plan["suggestion"] = None
    if plan["fits"] is False:
        plan["suggestion"] = suggest.suggest(pipe, params.train, device_memory, path, head=head)
    return plan


def inspect(params: Params, overrides: dict[str, Any] | None = None,
            device_memory: int | None = None) -> dict[str, Any]:
    """{"model", "total_params", "overrides", "pipeline": path or None, and for the first pipeline found:
    "num_micro_batches", "remat" (the policy), "balance", "cost_kind", "note", "estimate_notes", "stages":
    [{"stage", "params", "layers", "remat", "cost", "activation_bytes_estimate"}, ...]}.

    `overrides`: what the command changed (e.g. {"gin_param": [...], "params": "..."}), echoed in the report.
    `device_memory`: bytes per device; the report's "memory" (`memory.plan.plan_pipeline`, plus "suggestion") then
    says whether each device fits, and an estimate that cannot be made raises ConfigError instead of a note.
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
            plan = make_plan(pipe, chunk_devices=step_order(pipe.schedule, pipe.num_stages, path).devices_by_chunk,
                             num_replicas=None, measure=None, path=path)
        except TimingRequiredError as e:
            report["note"] = str(e)
            return report
        stages, notes = _stages(pipe, plan, path)
        memory = _memory(params, pipe, path, stages, notes, device_memory)
        report.update(balance=list(plan.balance), cost_kind=plan.cost_kind, stages=stages, estimate_notes=notes,
                      memory=memory, num_stages=plan.num_devices, chunk_devices=list(plan.chunk_devices))
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as text: totals, then one line per stage."""
    lines = [f"model {report['model']}: {report['total_params']:,} trainable parameters "
             f"({human(report['total_params'] * 4)} in float32)"]
    for name, value in report.get("overrides", {}).items():
        lines.append(f"overrides --{name}: " + (", ".join(value) if isinstance(value, (list, tuple)) else value))
    if report["stages"]:
        k = report.get("num_stages", len(report["stages"]))
        chunks = report.get("chunk_devices") or []
        per_device = "" if len(chunks) <= k else (
            f" x {len(chunks) // k} chunks per device (chunk devices {' '.join(map(str, chunks))})")
        lines.append(f"pipeline {report['pipeline']}: K={k}{per_device} M={report['num_micro_batches']} "
                     f"remat={report['remat']}")
        lines.append(_balance_text(report))
        lines.append(f"{'stage':>5}  {'params':>16}  {'remat':<5}  {'activations (est.)':>18}  layers")
        for s in report["stages"]:
            act = s["activation_bytes_estimate"]
            act_text = "-" if act is None else human(act)
            params_text = "-" if s["params"] is None else f"{s['params']:,}"
            span = f"{s['layers'][0]} .. {s['layers'][-1]}" if len(s["layers"]) > 1 else s["layers"][0]
            lines.append(f"{s['stage']:>5}  {params_text:>16}  {'yes' if s['remat'] else 'no':<5}  {act_text:>18}  "
                         f"{span}")
        if report.get("memory"):
            lines += format_memory(report["memory"])
        lines += [f"note: {note}" for note in report["estimate_notes"]]
    elif report.get("note"):
        lines.append(f"pipeline {report['pipeline']}: no stages shown. {report['note']}")
    return "\n".join(lines)


_MEMORY_COLUMNS = (("weights", "weights"), ("gradient_sums", "grad sums"), ("optimizer_slots", "opt slots"),
                   ("ema", "ema"), ("stashed_activations", "stashes"), ("recompute", "recompute"),
                   ("boundary_buffers", "boundary"), ("backward_working", "bwd work"), ("loss_head", "loss head"),
                   ("optimizer_update", "update"),
                   ("peak", "peak"))


def format_memory(memory: dict[str, Any]) -> list[str]:
    """The per-device memory plan as text lines: one row per device, then the verdict and the suggestion."""
    budget = memory["device_memory"]
    lines = [f"memory per device (predicted; schedule {memory['schedule']}, remat {memory['remat']}, compute "
             f"{memory['compute_dtype']}, optimizer slots {memory['optimizer_slot_copies']:g} x weights"
             + (", EMA" if memory["ema"] else "") + (f", budget {human(budget)}" if budget else "") + "):",
             "device  stash " + "  ".join(f"{title:>10}" for _, title in _MEMORY_COLUMNS) + "  fits"]
    for row in memory["devices"]:
        fits = "-" if row["fits"] is None else ("yes" if row["fits"] else "NO")
        lines.append(f"{row['device']:>6}  {row['stashed_micro_batches']:>5} "
                     + "  ".join(f"{human(row[key]):>10}" for key, _ in _MEMORY_COLUMNS) + f"  {fits}")
    lines.append("peak = weights + grad sums + opt slots + ema + boundary + max(stashes + recompute + bwd work + loss "
                 "head, update); the loss head's weights are in the last chunk's device's columns"
                 + (f"; {memory['schedule']}'s loss head ends before any backward, so on the last device: "
                    "max(stashes + recompute + bwd work, stashes + loss head + the optimizer's early temporaries "
                    "+ the activation flowing, update)"
                    if any(r.get("forward_working") for r in memory["devices"]) else "")
                 + ("; a device's several chunks add their columns, but one chunk's backward runs at a time: its "
                    "recompute, bwd work (less the optimizer's early temporaries, which every chunk holds) and loss "
                    "head count once" if memory.get("virtual_stages", 1) > 1 else ""))
    if budget is not None:
        if memory["fits"]:
            lines.append(f"fits: every device's peak is within {human(budget)} (largest {human(memory['max_peak'])})")
        else:
            over = sum(1 for r in memory["devices"] if not r["fits"])
            lines.append(f"does NOT fit: {over} of {len(memory['devices'])} devices exceed {human(budget)} "
                         f"(largest peak {human(memory['max_peak'])})")
            hint = memory.get("suggestion")
            if hint:
                lines.append(f"smallest change that fits with {suggest.HEADROOM:.0%} headroom: {hint['change']} "
                             f"(largest peak {human(hint['max_peak'])}): --params={hint['params']}")
            else:
                lines.append(f"no single change or pair of changes (1F1B, more micro-batches, remat, bfloat16, more "
                             f"stages) fits with {suggest.HEADROOM:.0%} headroom: more devices or a smaller model")
    return lines
