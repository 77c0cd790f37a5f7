"""Where pipeline stages run, and keeping each stage's backward pass on the stage's device.

One abstraction for every kind of device: `stage_devices(K, kind)` returns K TensorFlow device strings.

* ``cpu``: logical CPUs of this process (`--logical_devices=N`); correctness tests, not timing.
* ``gpu``: one stage per GPU (physical or virtual), round-robin when K exceeds the GPU count.
* ``tpu``: TPU cores of an initialized TPU system (`tf.config.list_logical_devices('TPU')`), stage k on core k.
* ``workers``: stage k on ``/job:worker/replica:0/task:k``: TF server processes, local (one core each, a faithful
  CPU simulation) or on other hosts, after `tf.config.experimental_connect_to_cluster`.
* ``auto``: GPUs if any, else TPU cores if any, else logical CPUs.

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
from typing import Iterator

import tensorflow as tf

from gpipe_tf.hyperparams import ParamsError

DEVICE_KINDS = ("auto", "cpu", "gpu", "tpu", "workers")

_SCOPE_DEVICES: dict[str, str] = {}
_SCOPE_IDS = itertools.count()
_SCOPE_RE = re.compile(r"gpipe\d+_stage\d+")


def stage_devices(num_stages: int, kind: str = "auto", worker_job: str = "worker") -> list[str]:
    """Device strings for `num_stages` stages of kind `kind` (see the module doc); round-robin if fewer devices."""
    if kind not in DEVICE_KINDS:
        raise ParamsError(f"device kind {kind!r} is not one of {DEVICE_KINDS}")
    if kind == "workers":
        return [f"/job:{worker_job}/replica:0/task:{k}/device:CPU:0" for k in range(num_stages)]
    if kind == "auto":
        kind = next((k for k in ("gpu", "tpu") if tf.config.list_logical_devices(k.upper())), "cpu")
    devices = [d.name for d in tf.config.list_logical_devices(kind.upper())]
    if not devices:
        raise ParamsError(f"no {kind.upper()} devices are visible; use device_kind='auto' or 'cpu'")
    return [devices[k % len(devices)] for k in range(num_stages)]


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


def _gradient_device(op: tf.Operation) -> str:
    if op.device:
        return op.device
    tokens = _SCOPE_RE.findall(op.name)
    if tokens:
        return _SCOPE_DEVICES.get(tokens[-1], "")
    for tensor in op.inputs:
        if tensor.op.device:
            return tensor.op.device
    return ""


@contextlib.contextmanager
def colocate_gradients() -> Iterator[None]:
    """Places gradient ops built in this context on their pipeline stage's device (graph mode; eager: no-op)."""
    if tf.executing_eagerly():
        yield
        return
    with tf.compat.v1.get_default_graph().device(_gradient_device):
        yield
