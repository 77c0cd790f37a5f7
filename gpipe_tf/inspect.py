"""`--mode=inspect`: parameters and memory of a model, per pipeline stage, from Params alone.

Nothing is built: counts and shapes come from each layer's `num_params` and `output_spec` classmethods, so a
multi-billion-parameter configuration is inspected in seconds on any machine.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import partition, remat
from gpipe_tf.gpipe.pipeline import GPipe
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


def _stages(pipe: InstantiableParams) -> list[dict[str, Any]]:
    layers = list(pipe.layers)
    counts = partition.layer_param_counts(layers)
    k = pipe.num_stages
    if pipe.balance is not None:
        balance = partition.check_balance(pipe.balance, len(layers), k)
    elif pipe.balance_by == "flops" and pipe.micro_batch_shape is not None:
        spec = tf.TensorSpec(pipe.micro_batch_shape, pipe.input_dtype)
        balance = partition.balance_costs(partition.layer_flops(layers, spec), k)
    else:
        balance = partition.balance_costs([float(c) for c in counts], k)
    spec = None if pipe.micro_batch_shape is None else tf.TensorSpec(pipe.micro_batch_shape, pipe.input_dtype)
    stages, start = [], 0
    for stage, size in enumerate(balance):
        entry: dict[str, Any] = {"stage": stage, "params": sum(counts[start:start + size]),
                                 "layers": [f"layer_{j}" for j in range(start, start + size)],
                                 "activation_bytes_estimate": None}
        if spec is not None:
            try:
                input_bytes, outputs = _bytes(spec), []
                for lp in layers[start:start + size]:
                    spec = lp.cls.output_spec(lp, spec)
                    outputs.append(_bytes(spec))
                m = pipe.num_micro_batches
                if remat.stage_uses_remat(pipe.remat, stage, k):
                    # Inputs of every micro-batch, plus one micro-batch's activations while it is recomputed.
                    entry["activation_bytes_estimate"] = m * input_bytes + sum(outputs)
                else:
                    entry["activation_bytes_estimate"] = m * sum(outputs)
            except NotImplementedError:
                spec = None
        stages.append(entry)
        start += size
    return stages


def inspect(params: Params) -> dict[str, Any]:
    """{"model", "total_params", "param_bytes", "stages": [{"stage", "params", "layers",
    "activation_bytes_estimate"}, ...], "pipeline": path or None}; stages of the first pipeline found."""
    total = count_params(params.task)
    pipelines = find_pipelines(params.task)
    report: dict[str, Any] = {"model": params.model, "total_params": total, "pipeline": None, "stages": []}
    if pipelines:
        path, pipe = pipelines[0]
        report["pipeline"] = path
        report["num_micro_batches"] = pipe.num_micro_batches
        report["remat"] = pipe.remat
        report["stages"] = _stages(pipe)
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
        lines.append(f"pipeline {report['pipeline']}: K={len(report['stages'])} M={report['num_micro_batches']} "
                     f"remat={report['remat']}")
        lines.append(f"{'stage':>5}  {'params':>16}  {'activations (est.)':>18}  layers")
        for s in report["stages"]:
            act = s["activation_bytes_estimate"]
            act_text = "-" if act is None else _human(act)
            span = f"{s['layers'][0]} .. {s['layers'][-1]}" if len(s["layers"]) > 1 else s["layers"][0]
            lines.append(f"{s['stage']:>5}  {s['params']:>16,}  {act_text:>18}  {span}")
    return "\n".join(lines)
