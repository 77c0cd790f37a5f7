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

import contextlib
import glob
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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


def _trace_files(logdir: str) -> list[str]:
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir}: the profiler wrote no trace")
    return paths


# One op run on an executor thread: (start s, end s, node name, op type).
Event = tuple[float, float, str, str]


def read_space(path: str) -> Any:
    """The profiler's XSpace protobuf in one `*.xplane.pb` trace file."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def read_events(path: str) -> list[Event]:
    """The ops run on the executor threads in one `*.xplane.pb` trace file, sorted by start."""
    space = read_space(path)
    events = []
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):  # the executor's threads; the python line nests calls
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name or any(tag in name for tag in _NOT_OPS):
                    continue
                node, op_type = name.rsplit(":", 1)
                start = line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
                events.append((start, start + event.duration_ps * 1e-12, node, op_type))
    return sorted(events)


def _file_op_seconds(path: str) -> tuple[dict[str, float], float]:
    """(seconds by op type, seconds from the first op's start to the last op's end) of one trace file."""
    totals: dict[str, float] = {}
    events = read_events(path)
    for start, end, _, op_type in events:
        totals[op_type] = totals.get(op_type, 0.0) + (end - start)
    span = max(end for _, end, _, _ in events) - events[0][0] if events else 0.0
    return totals, max(0.0, span)


def op_seconds(logdir: str) -> dict[str, float]:
    """Seconds of op execution by op type in the profiler traces (`*.xplane.pb`) under `logdir`."""
    totals: dict[str, float] = {}
    for path in _trace_files(logdir):
        for op_type, seconds in _file_op_seconds(path)[0].items():
            totals[op_type] = totals.get(op_type, 0.0) + seconds
    return totals


def by_category(op_type_seconds: dict[str, float], wall: float) -> dict[str, float]:
    """Seconds by category from seconds by op type; 'idle' is what `wall` leaves (0 if ops overlapped more)."""
    result = {c: 0.0 for c in CATEGORIES}
    for op_type, seconds in op_type_seconds.items():
        result[category(op_type)] += seconds
    result["idle"] = max(0.0, wall - sum(result.values()))
    return result


@contextlib.contextmanager
def worker_traces(profiler_addresses: Sequence[str], run_step: Callable[[], object], duration_ms: int,
                  pause_s: float = 0.0) -> Iterator[list[str]]:
    """Traces the workers' profiler servers for `duration_ms` while `run_step` runs steps (`pause_s` apart) in a
    thread; yields each worker's `*.xplane.pb` trace file, in the order of `profiler_addresses`, for as long as the
    context lasts. An exception of `run_step` is re-raised here."""
    import tensorflow as tf

    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                run_step()
                if pause_s:
                    time.sleep(pause_s)
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    runner = threading.Thread(target=loop, daemon=True)
    with tempfile.TemporaryDirectory(prefix="worker_trace_") as logdir:
        runner.start()
        try:
            service = ",".join(f"grpc://{address}" for address in profiler_addresses)
            tf.profiler.experimental.client.trace(service, logdir, duration_ms)
        finally:
            stop.set()
            runner.join()
        if errors:
            raise errors[0]
        # One file per worker, named after its profiler address.
        by_address = {os.path.basename(p).split(".xplane")[0].replace("_", ":"): p for p in _trace_files(logdir)}
        missing = [a for a in profiler_addresses if a not in by_address]
        if missing:
            raise FileNotFoundError(f"no trace from the worker profilers at {missing}; got {sorted(by_address)}")
        yield [by_address[a] for a in profiler_addresses]


def trace_workers(profiler_addresses: Sequence[str], run_step: Callable[[], object],
                  duration_ms: int = 3000) -> list[dict[str, float]]:
    """Each worker's time by category, as fractions of its traced span, while `run_step` runs steps back to back.

    `profiler_addresses` are the workers' profiler servers (`workers.LocalWorkers(..., profiler=True)`), in task
    order. The span runs from the worker's first traced op to its last (about `duration_ms`); idle is the part of
    it in which no op of that worker ran. Returns one dict per worker: category -> fraction of the span.
    """
    shares = []
    with worker_traces(profiler_addresses, run_step, duration_ms) as paths:
        for address, path in zip(profiler_addresses, paths):
            by_type, span = _file_op_seconds(path)
            if span <= 0:
                raise RuntimeError(f"the trace of the worker at {address} holds no op: no step ran while tracing")
            shares.append({c: t / span for c, t in by_category(by_type, span).items()})
    return shares


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
    return by_category({op_type: seconds / steps for op_type, seconds in by_type.items()}, wall)


def format_breakdown(seconds: dict[str, float]) -> str:
    """One line: each category's share of the step, e.g. 'matmul 81.2%  attention 5.0%  ...'."""
    total = sum(seconds.values()) or 1.0
    return "  ".join(f"{c} {100.0 * seconds.get(c, 0.0) / total:.1f}%" for c in CATEGORIES)
