"""Where a step's time goes: TensorFlow profiler events of a few steps, summed by op category.

Categories (by op type; the layers add no name scopes, so the type is what a trace can tell apart):

* matmul: dense projections (MatMul and oneDNN's fused forms, BatchMatMul);
* attention: the logits and context einsums and the softmax (Einsum is used by attention alone here);
* normalization: layer and batch norm statistics and their gradients (mean, variance, rsqrt, fused batch norm);
* elementwise: every other compute op (adds, multiplies, activations, reductions, optimizer updates);
* transfer: sends, receives and copies between devices;
* idle: the step's wall time not covered by any op (executor overhead, waiting).

On a single-thread executor the ops run one at a time, so op time plus idle is the step's wall time. With more
threads, ops overlap and the categories sum to more than the wall time; `breakdown` reports shares of the op
time then and says so.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from typing import Callable

CATEGORIES = ("matmul", "attention", "normalization", "elementwise", "transfer", "idle")

_MATMUL = {"MatMul", "_MklMatMul", "_MklNativeMatMul", "_FusedMatMul", "_MklFusedMatMul", "_MklNativeFusedMatMul",
           "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "_MklBatchMatMul", "_MklBatchMatMulV2"}
_ATTENTION = {"Einsum", "_MklEinsum", "Softmax", "_MklSoftmax", "SoftmaxGrad", "LogSoftmax"}
_NORMALIZATION = {"Mean", "SquaredDifference", "Rsqrt", "RsqrtGrad", "FusedBatchNormV3", "FusedBatchNormGradV3",
                  "_MklFusedBatchNormV3", "_MklFusedBatchNormGradV3", "_MklLayerNorm"}
_TRANSFER = {"_Send", "_Recv", "_HostSend", "_HostRecv", "Send", "Recv", "_MklToTf", "CopyToDevice",
             "EagerCopyToDevice"}
# Events on the executor's threads that are not ops (regions, allocations, bookkeeping).
_NOT_OPS = ("::", "MemoryAllocation", "MemoryDeallocation")


def category(op_type: str) -> str:
    """The category (one of CATEGORIES except 'idle') of an op type, e.g. '_MklMatMul' -> 'matmul'."""
    if op_type in _MATMUL:
        return "matmul"
    if op_type in _ATTENTION:
        return "attention"
    if op_type in _NORMALIZATION:
        return "normalization"
    if op_type in _TRANSFER:
        return "transfer"
    return "elementwise"


def op_seconds(logdir: str) -> dict[str, float]:
    """Seconds of op execution by op type in the profiler trace (`*.xplane.pb`) under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir}: the profiler wrote no trace")
    totals: dict[str, float] = {}
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = plane.event_metadata
            for line in plane.lines:
                if not line.name.startswith("tf_Compute"):  # the executor's threads; the python line nests calls
                    continue
                for event in line.events:
                    name = names[event.metadata_id].name
                    if ":" not in name or any(tag in name for tag in _NOT_OPS):
                        continue
                    op_type = name.rsplit(":", 1)[1]
                    totals[op_type] = totals.get(op_type, 0.0) + event.duration_ps / 1e12
    return totals


def breakdown(run_step: Callable[[], object], steps: int = 3) -> dict[str, float]:
    """Profiles `steps` calls of `run_step` (already warmed up) and returns seconds per step by category.

    'idle' is the wall time per step minus the op time per step (0 if ops overlapped by more than that).
    """
    import tensorflow as tf

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="op_breakdown_") as logdir:
        tf.profiler.experimental.start(logdir)
        start = time.perf_counter()
        try:
            for _ in range(steps):
                run_step()
        finally:
            wall = (time.perf_counter() - start) / steps
            tf.profiler.experimental.stop()
        by_type = op_seconds(logdir)
    result = {c: 0.0 for c in CATEGORIES}
    for op_type, seconds in by_type.items():
        result[category(op_type)] += seconds / steps
    result["idle"] = max(0.0, wall - sum(result.values()))
    return result


def format_breakdown(seconds: dict[str, float]) -> str:
    """One line: each category's share of the step, e.g. 'matmul 81.2%  attention 5.0%  ...'."""
    total = sum(seconds.values()) or 1.0
    return "  ".join(f"{c} {100.0 * seconds.get(c, 0.0) / total:.1f}%" for c in CATEGORIES)
