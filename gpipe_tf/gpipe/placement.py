"""Where pipeline stages run, and keeping each stage's backward pass on the stage's device.

One abstraction for every kind of device: `stage_devices(K, kind)` returns K TensorFlow device strings.

* ``cpu``: logical CPUs of this process (`--logical_devices=N`); correctness tests, not timing.
* ``gpu``: one stage per GPU (physical or virtual), round-robin when K exceeds the GPU count.
* ``tpu``: TPU cores of an initialized TPU system (`tf.config.list_logical_devices('TPU')`), stage k on core k.
* ``workers``: stage k on ``/job:worker/replica:0/task:k``: TF server processes, local (one core each, a faithful
  CPU simulation) or on other hosts, after `tf.config.experimental_connect_to_cluster`.
* ``auto``: GPUs if any, else TPU cores if any, else logical CPUs.

Data parallelism (D replicas of a K-stage pipeline, `train.num_replicas`): `replica_stage_devices(D, K, kind)` is
the one mapping from (replica r, stage k) to a device, `devices[r * K + k]`, so a replica's stages are neighbours
(on GPUs, one NVLink island per replica). The partition table prints it. While the trainer builds a task,
`replicas(D)` tells every pipeline how many replicas to prepare; while it traces replica r's step,
`on_replica(r)` tells them which one runs.

TensorFlow's autodiff does not place gradient ops next to their forward ops inside `tf.function` (a while loop's
backward body gets no device at all), so the whole backward would run on one device. `colocate_gradients()`
installs a device function for the duration of a `tape.gradient` call: every gradient op created under a pipeline
stage's name scope goes to that stage's device, and ops outside any stage (e.g. the running sums of weight
gradients) go where their first placed input is.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable, Iterator

import tensorflow as tf

from gpipe_tf.hyperparams import ParamsError

DEVICE_KINDS = ("auto", "cpu", "gpu", "tpu", "workers")

_SCOPE_DEVICES: dict[str, str] = {}
_SCOPE_IDS = itertools.count()
_SCOPE_RE = re.compile(r"gpipe\d+_stage\d+")


_AUTO_KIND: dict[str, str | None] = {"kind": None}


def set_auto_kind(kind: str | None) -> None:
    """Makes device_kind 'auto' mean `kind` in this process (the trainer's --stage_workers); None: the default."""
    if kind is not None and kind not in DEVICE_KINDS[1:]:
        raise ParamsError(f"device kind {kind!r} is not one of {DEVICE_KINDS[1:]}")
    _AUTO_KIND["kind"] = kind


def stage_devices(num_stages: int, kind: str = "auto", worker_job: str = "worker") -> list[str]:
    """Device strings for `num_stages` stages of kind `kind` (see the module doc); round-robin if fewer devices."""
    if kind not in DEVICE_KINDS:
        raise ParamsError(f"device kind {kind!r} is not one of {DEVICE_KINDS}")
    if kind == "auto" and _AUTO_KIND["kind"]:
        kind = _AUTO_KIND["kind"]
    if kind == "workers":
        return [f"/job:{worker_job}/replica:0/task:{k}/device:CPU:0" for k in range(num_stages)]
    if kind == "auto":
        kind = next((k for k in ("gpu", "tpu") if tf.config.list_logical_devices(k.upper())), "cpu")
    devices = [d.name for d in tf.config.list_logical_devices(kind.upper())]
    if not devices:
        raise ParamsError(f"no {kind.upper()} devices are visible; use device_kind='auto' or 'cpu'")
    return [devices[k % len(devices)] for k in range(num_stages)]


def replica_stage_index(replica: int, stage: int, num_stages: int) -> int:
    """The device index of replica `replica`'s stage `stage`: the one mapping every device kind uses."""
    return replica * num_stages + stage


def replica_stage_devices(num_replicas: int, num_stages: int, kind: str = "auto",
                          worker_job: str = "worker") -> list[list[str]]:
    """Devices of D replicas of a K-stage pipeline: replica r, stage k on device r * K + k of `kind`.

    Needs D * K devices except on logical CPUs and workers of one process, where stages may share devices
    (round-robin, for correctness runs); a GPU or TPU host with too few devices is a clear error.
    """
    if num_replicas < 1:
        raise ParamsError(f"num_replicas={num_replicas} must be >= 1")
    if kind == "workers" or (kind == "auto" and _AUTO_KIND["kind"] == "workers"):
        if num_replicas > 1:
            raise ParamsError(f"num_replicas={num_replicas} with device_kind='workers': the stage workers hold one "
                              "replica; run one trainer per replica (TF_CONFIG, docs/scaling_out.md) instead")
        return [stage_devices(num_stages, "workers", worker_job)]
    flat = stage_devices(num_replicas * num_stages, kind)
    resolved = flat[0].split("device:")[-1].split(":")[0] if flat else "CPU"
    if resolved != "CPU":
        available = len(tf.config.list_logical_devices(resolved))
        if available < num_replicas * num_stages:
            raise ParamsError(f"{num_replicas} replicas x {num_stages} stages need {num_replicas * num_stages} "
                              f"{resolved} devices, {available} are visible; lower train.num_replicas or num_stages")
    return [[flat[replica_stage_index(r, k, num_stages)] for k in range(num_stages)] for r in range(num_replicas)]


_REPLICAS = {"count": 1, "current": 0}


@contextlib.contextmanager
def replicas(num_replicas: int) -> Iterator[None]:
    """Pipelines built in this context prepare `num_replicas` data-parallel replicas (devices, gradient sums)."""
    previous = _REPLICAS["count"]
    _REPLICAS["count"] = num_replicas
    try:
        yield
    finally:
        _REPLICAS["count"] = previous


def num_replicas() -> int:
    """The replica count pipelines built now prepare (1 outside `replicas(...)`)."""
    return _REPLICAS["count"]


@contextlib.contextmanager
def on_replica(replica: int) -> Iterator[None]:
    """Pipelines traced in this context run as local replica `replica` (its devices and gradient sums)."""
    previous = _REPLICAS["current"]
    _REPLICAS["current"] = replica
    try:
        yield
    finally:
        _REPLICAS["current"] = previous


def current_replica() -> int:
    """The local replica being traced (0 outside `on_replica(...)`)."""
    return _REPLICAS["current"]


def new_pipeline_id() -> int:
    """A process-unique id for one pipeline's stage scopes."""
    return next(_SCOPE_IDS)


def stage_scope(pipeline_id: int, stage: int, device: str) -> str:
    """The name-scope token of one stage of one pipeline, remembered with its device."""
    token = f"gpipe{pipeline_id}_stage{stage}"
    _SCOPE_DEVICES[token] = device
    return token


@contextlib.contextmanager
def on_stage(token: str) -> Iterator[None]:
    """Builds ops inside a stage: its name scope (for gradient colocation) and its device."""
    with tf.name_scope(token), tf.device(_SCOPE_DEVICES[token]):
        yield


_LOOP_OPS = ("While", "StatelessWhile")


def host_device() -> str:
    """This process's own CPU, fully named (e.g. ``/job:localhost/replica:0/task:0/device:CPU:0``)."""
    with tf.init_scope(), tf.compat.v1.device(None), tf.device("/device:CPU:0"):
        return tf.constant(0).device


def loop_device(counters: str, condition: str) -> Callable[[tf.Operation], str]:
    """A device function for building a while loop whose state stays on each stage's device.

    A lowered while loop places each loop variable's nodes with its initial value, and its condition (and any
    unplaced node of its body) on the While op's device. So: ops built under a stage's name scope on that
    stage's device; other unplaced ops (e.g. the loop counter) on `counters`; the While op on `condition`.
    Then nothing but what a stage sends to the next, and the condition, crosses devices each micro-batch.

    `condition` should be a device that runs no stage (`host_device()`): every stage waits for the condition
    of its next micro-batch, and a single-thread worker busy with a stage's long chain of ops handles a message
    only when that chain ends, so a condition on a stage's device would make every other stage wait for that
    chain before its next micro-batch (docs/pipeline.md#schedules).
    """
    def device(op: tf.Operation) -> str:
        if op.type in _LOOP_OPS:
            return condition
        return op.device or _stage_device(op) or counters
    return device


def _stage_device(op: tf.Operation) -> str:
    tokens = _SCOPE_RE.findall(op.name)
    return _SCOPE_DEVICES.get(tokens[-1], "") if tokens else ""


def _gradient_device(op: tf.Operation, counters: str = "", condition: str = "") -> str:
    if op.type in _LOOP_OPS:
        return condition  # see loop_device
    if op.device:
        return op.device
    if _SCOPE_RE.search(op.name):
        return _stage_device(op)
    for tensor in op.inputs:
        device = _tensor_device(tensor)
        if device:
            return device
    if condition and op.outputs and all(t.dtype in (tf.int32, tf.int64, tf.bool) for t in op.outputs):
        return condition  # the gradient loop's counter and condition: beside its While op, waiting for no stage
    return counters


def _tensor_device(tensor: tf.Tensor) -> str:
    """Where `tensor` lives; a while loop's output lives where its loop variable started (see loop_device)."""
    while tensor.op.type in _LOOP_OPS:
        tensor = tensor.op.inputs[tensor.value_index]
    return tensor.op.device


@contextlib.contextmanager
def colocate_gradients(counters: str = "", condition: str = "") -> Iterator[None]:
    """Places gradient ops built in this context on their pipeline stage's device (graph mode; eager: no-op).

    For the gradient of a loop built with `loop_device(counters, condition)`: `condition` is the device of the
    gradient loop's While op, and of its integer and boolean ops with no stage and no placed input (its counter
    and condition, so that no stage has to answer before the next micro-batch's backward); `counters` that of
    the other gradient ops with no stage and no placed input (the incoming gradient of each loop variable, e.g.
    of the output TensorArrays). Empty: TensorFlow's default device.
    """
    if tf.executing_eagerly():
        yield
        return
    with tf.compat.v1.get_default_graph().device(
            lambda op: _gradient_device(op, counters, condition)):
        yield
