"""One line for a device that ran out of memory: which device, which pipeline stage, what the planner predicted
there and the smallest change it finds that fits; and, before training, a warning where the plan already does not
fit.

TensorFlow reports an exhausted allocator in two ways. A kernel's allocation is a `ResourceExhaustedError` whose
message names the tensor and the device ("OOM when allocating tensor with shape[8192,1048576] and type float on
/job:localhost/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc"): `explain` maps that device back to the
(replica, stage) that runs there (`placement.replica_stage_devices`, the mapping the pipeline itself uses). A
constant Grappler folded from a fixed-shape op (a `zeros_like` or `fill`) that its allocator cannot hold is an
`InvalidArgumentError` "Cannot parse tensor from proto" naming no device: there the stage comes from the op's name
scope, gpipe<i>_stage<c>. Either way the planner gives that device's predicted peak and a change that fits: the
budget is the user's `--device_memory` when given, otherwise the failing device's own predicted peak (a device
that ran out holds less than the model needs, so the change must at least lower every device's peak below it).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import tensorflow as tf
from tensorflow.core.framework import types_pb2

from gpipe_tf import errors
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.pipeline import find_pipelines
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.memory import suggest
from gpipe_tf.memory.head import task_head
from gpipe_tf.memory.plan import plan_pipeline, schedule_order
from gpipe_tf.memory.sizes import human

_OOM = re.compile(r"OOM when allocating tensor with shape\s*\[([^\]]*)\]\s*and type (\w+) on (\S+)")
_CONSTANT = re.compile(r"Cannot parse tensor from proto.*?dtype: (DT_\w+)\s*tensor_shape \{(.*?)\n\}", re.S)
_DIM = re.compile(r"size: (\d+)")
_STAGE_NODE = re.compile(r"node [^\]]*?gpipe(\d+)_stage(\d+)")


class StageAt(NamedTuple):
    """Where an allocation failed: a pipeline (its path and Params) and the stage, of replica `replica` of
    `replicas`."""

    path: str
    pipe: Any
    replica: int
    stage: int
    replicas: int


def _allocation(shape: list[int], dtype: Any, device: str | None) -> dict[str, Any]:
    """{"shape", "dtype" (TensorFlow's name, e.g. float32), "device", "bytes"} of a tensor; `dtype` as TensorFlow's
    message or proto names it."""
    dtype = tf.as_dtype(dtype)
    count = 1
    for d in shape:
        count *= d
    return {"shape": shape, "dtype": dtype.name, "device": device, "bytes": count * dtype.size}


def parse(message: str) -> dict[str, Any] | None:
    """The allocation TensorFlow's OOM message names, or None when `message` names none (e.g. a full queue)."""
    found = _OOM.search(message)
    if found is None:
        return None
    return _allocation([int(d) for d in found.group(1).split(",") if d.strip()], found.group(2), found.group(3))


def parse_constant(message: str) -> dict[str, Any] | None:
    """The allocation of a folded constant that could not be created, with "pipeline" and "stage" from its node's
    name scope (None when no pipeline stage built it); None when `message` is no such error."""
    found = _CONSTANT.search(message)
    if found is None:
        return None
    out = _allocation([int(d) for d in _DIM.findall(found.group(2))], types_pb2.DataType.Value(found.group(1)), None)
    node = _STAGE_NODE.search(message)
    out["pipeline"], out["stage"] = (int(node.group(1)), int(node.group(2))) if node else (None, None)
    return out


def find_message(error: BaseException) -> str | None:
    """The message of the out-of-memory error in `error`'s chain (either kind, see the module doc), or None."""
    oom = errors.find_in_chain(error, (tf.errors.ResourceExhaustedError,))
    if oom is not None:
        return oom.message
    bad = errors.find_in_chain(error, (tf.errors.InvalidArgumentError,))
    return bad.message if bad is not None and parse_constant(bad.message) else None


def same_device(a: str, b: str) -> bool:
    """Whether device strings `a` and `b` name one device ('/device:CPU:1' is '/job:localhost/.../device:CPU:1')."""
    x, y = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    if (x.device_type or "").upper() != (y.device_type or "").upper():
        return False
    if (x.device_index or 0) != (y.device_index or 0):
        return False
    return all(p is None or q is None or p == q for p, q in ((x.job, y.job), (x.replica, y.replica),
                                                              (x.task, y.task)))


def find_stage(params: Params, device: str) -> StageAt | None:
    """The pipeline stage placed on `device`, or None."""
    replicas = int(params.train.get("num_replicas") or 1) if "train" in params else 1
    for path, pipe in find_pipelines(params.task):
        try:
            nested = placement.replica_stage_devices(replicas, pipe.num_stages, pipe.device_kind)
        except ParamsError:  # its device kind has no devices in this process: no stage of it ran out here
            continue
        for r, devices in enumerate(nested):
            for k, name in enumerate(devices):
                if same_device(name, device):
                    return StageAt(path, pipe, r, k, replicas)
    return None


def stage_of_node(params: Params, pipeline: int | None, chunk: int | None) -> StageAt | None:
    """The stage of pipeline `pipeline`'s chunk `chunk` (name scope gpipe<pipeline>_stage<chunk>; chunk c runs on
    the device its schedule's order gives: c mod K but for a V), or None. With one pipeline in the task it is that
    one whatever its process-wide number; the replica is unknown (0 of 1)."""
    pipelines = find_pipelines(params.task)
    if pipeline is None or chunk is None or not pipelines:
        return None
    if len(pipelines) > 1 and pipeline >= len(pipelines):
        return None
    path, pipe = pipelines[0] if len(pipelines) == 1 else pipelines[pipeline]
    order = schedule_order(pipe, path)
    return StageAt(path, pipe, 0, order.device(chunk), 1) if chunk < order.num_chunks else None


def explain(message: str, params: Params, device_memory: int | None = None, budget_text: str = "") -> str:
    """One line for TensorFlow's OOM `message` in a run of `params`: the device, the tensor, the pipeline stage
    placed there, the planner's predicted peak on it and the smallest change that fits `device_memory` (or, without
    a budget, the failing device's predicted peak); `budget_text` is `device_memory` as the user wrote it."""
    oom = parse(message)
    constant = None if oom is not None else parse_constant(message)
    found = oom or constant
    if found is None:
        return f"out of memory: {' '.join(message.split())[:300]}; use a smaller batch or more devices"
    shape = "x".join(str(d) for d in found["shape"]) or "scalar"
    size = f"[{shape}], {human(found['bytes'])}"
    if oom is not None:
        line = f"out of memory on {oom['device']} while allocating a {oom['dtype']} tensor {size}"
        at = find_stage(params, oom["device"])
    else:
        line = (f"out of memory while creating a {constant['dtype']} constant {size} that TensorFlow folded from a "
                "fixed-shape op (reported as 'Cannot parse tensor from proto')")
        at = stage_of_node(params, constant["pipeline"], constant["stage"])
    if at is None:
        return (f"{line}; no pipeline stage runs there (the model's other layers, the input or the optimizer do), "
                "so the memory planner cannot say more: use a smaller batch, or put the model in a pipeline "
                "(--mode=inspect --device_memory=SIZE plans one)")
    where = f"{at.path} stage {at.stage} of {at.pipe.num_stages}" + (
        f", replica {at.replica} of {at.replicas}" if at.replicas > 1 else "")
    try:
        head = task_head(params.task, at.path)
        plan = plan_pipeline(at.pipe, params.train, at.path, device_memory, head=head)
    except ConfigError as e:
        return f"{line} ({where}); the memory planner cannot plan it: {e}"
    predicted = plan["devices"][at.stage]["peak"]
    line = f"{line} ({where}); the planner predicts a peak of {human(predicted)} on that device"
    if device_memory is not None:
        hint = suggest.suggest(at.pipe, params.train, device_memory, at.path, head=head)
        return f"{line}; {suggest.describe(hint, f'--device_memory={budget_text or device_memory}')}"
    hint = suggest.suggest(at.pipe, params.train, predicted, at.path, head=head)
    return (f"{line}; {suggest.describe(hint, f'{1 - suggest.HEADROOM:.0%} of that peak on every device')}"
            + ("; give --device_memory=SIZE (your device's memory) for the change that fits it" if hint else ""))


def plan_warnings(params: Params, device_memory: int, budget_text: str) -> list[str]:
    """Before training with --device_memory: one warning line per pipeline that cannot be planned or whose
    predicted peak exceeds `device_memory` on some device, with the smallest change that fits."""
    lines = []
    target = f"--device_memory={budget_text}"
    for path, pipe in find_pipelines(params.task):
        try:
            head = task_head(params.task, path)
            plan = plan_pipeline(pipe, params.train, path, device_memory, head=head)
        except ConfigError as e:
            lines.append(f"warning: {target}: {path} cannot be planned ({e})")
            continue
        if not plan["fits"]:
            over = ", ".join(str(d["device"]) for d in plan["devices"] if not d["fits"])
            hint = suggest.suggest(pipe, params.train, device_memory, path, head=head)
            lines.append(f"warning: the planner predicts {path} needs {human(plan['max_peak'])} on device(s) {over}, "
                         f"more than {target}; {suggest.describe(hint, target)}")
    return lines
