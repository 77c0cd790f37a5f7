"""One line for a device that ran out of memory: which device, which pipeline stage, what the planner predicted
there and the smallest change it finds that fits.

TensorFlow reports an exhausted allocator as a `ResourceExhaustedError` whose message names the tensor and the
device ("OOM when allocating tensor with shape[8192,1048576] and type float on
/job:localhost/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc"). `explain` maps that device back to the
(replica, stage) that runs there (`placement.replica_stage_devices`, the mapping the pipeline itself uses) and asks
the memory planner for that device's predicted peak and for a change that fits: the budget is the user's
`--device_memory` when given, otherwise the failing device's own predicted peak (a device that ran out holds less
than the model needs, so the change must at least lower every device's predicted peak below it).
"""

from __future__ import annotations

import re
from typing import Any

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.memory.sizes import human

_OOM = re.compile(r"OOM when allocating tensor with shape\s*\[([^\]]*)\]\s*and type (\w+) on (\S+)")
# A constant TensorFlow folded from a fixed-shape op (zeros_like, fill) that its allocator cannot hold is reported
# as an InvalidArgumentError naming the constant's proto; the node's name scope says which pipeline stage built it.
_CONSTANT = re.compile(r"Cannot parse tensor from proto.*?dtype: DT_(\w+)\s*tensor_shape \{(.*?)\n\}", re.S)
_DIM = re.compile(r"size: (\d+)")
_STAGE_NODE = re.compile(r"node [^\]]*?gpipe(\d+)_stage(\d+)")
_DTYPE_BYTES = {"float": 4, "double": 8, "half": 2, "bfloat16": 2, "int32": 4, "int64": 8, "int8": 1, "uint8": 1,
                "bool": 1, "complex64": 8, "complex128": 16}


def _allocation(shape: list[int], dtype: str, device: str | None) -> dict[str, Any]:
    count = 1
    for d in shape:
        count *= d
    size = _DTYPE_BYTES.get(dtype)
    return {"shape": shape, "dtype": dtype, "device": device, "bytes": None if size is None else count * size}


def parse(message: str) -> dict[str, Any] | None:
    """{"shape", "dtype", "device", "bytes" (None when the dtype is unknown)} of TensorFlow's OOM message, or None
    when `message` names no allocation (e.g. an exhausted queue)."""
    found = _OOM.search(message)
    if found is None:
        return None
    return _allocation([int(d) for d in found.group(1).split(",") if d.strip()], found.group(2), found.group(3))


def parse_constant(message: str) -> dict[str, Any] | None:
    """The allocation of a folded constant that could not be created ("Cannot parse tensor from proto" of a
    fixed-shape fill), with "pipeline" and "stage" from its node's name scope when a pipeline stage built it; None
    when `message` is no such error. Its "device" is None: the message does not name one."""
    found = _CONSTANT.search(message)
    if found is None:
        return None
    dtype = {"FLOAT": "float", "DOUBLE": "double", "HALF": "half"}.get(found.group(1), found.group(1).lower())
    out = _allocation([int(d) for d in _DIM.findall(found.group(2))], dtype, None)
    node = _STAGE_NODE.search(message)
    out["pipeline"], out["stage"] = (int(node.group(1)), int(node.group(2))) if node else (None, None)
    return out


def same_device(a: str, b: str) -> bool:
    """Whether device strings `a` and `b` name one device ('/device:CPU:1' is '/job:localhost/.../device:CPU:1')."""
    import tensorflow as tf

    x, y = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    if (x.device_type or "").upper() != (y.device_type or "").upper() or (x.device_index or 0) != (y.device_index
                                                                                                   or 0):
        return False
    return all(p is None or q is None or p == q for p, q in ((x.job, y.job), (x.replica, y.replica),
                                                              (x.task, y.task)))


def find_stage(params: Params, device: str) -> tuple[str, Any, int, int, int] | None:
    """(path, pipeline Params, replica, stage, replicas) of the pipeline stage placed on `device`, or None."""
    from gpipe_tf.gpipe import placement
    from gpipe_tf.inspection import find_pipelines

    replicas = int(params.train.get("num_replicas") or 1) if "train" in params else 1
    for path, pipe in find_pipelines(params.task):
        try:
            nested = placement.replica_stage_devices(replicas, pipe.num_stages, pipe.device_kind)
        except ParamsError:  # its device kind has no devices in this process: no stage of it ran out here
            continue
        for r, devices in enumerate(nested):
            for k, name in enumerate(devices):
                if same_device(name, device):
                    return path, pipe, r, k, replicas
    return None


def stage_of_node(params: Params, pipeline: int | None, chunk: int | None) -> tuple[str, Any, int, int, int] | None:
    """(path, pipeline Params, 0, stage, 1) for the op of pipeline `pipeline`'s chunk `chunk` (its name scope
    gpipe<pipeline>_stage<chunk>; chunk c runs on stage c mod K), or None. With one pipeline in the task it is that
    one whatever its process-wide number."""
    from gpipe_tf.inspection import find_pipelines

    pipelines = find_pipelines(params.task)
    if pipeline is None or chunk is None or not pipelines:
        return None
    if len(pipelines) > 1 and pipeline >= len(pipelines):
        return None
    path, pipe = pipelines[0] if len(pipelines) == 1 else pipelines[pipeline]
    return path, pipe, 0, chunk % pipe.num_stages, 1


def explain(message: str, params: Params, device_memory: int | None = None, budget_text: str = "") -> str:
    """One line for TensorFlow's OOM `message` in a run of `params`: the device, the tensor, the pipeline stage
    placed there, the planner's predicted peak on it and the smallest change that fits `device_memory` (or, without
    a budget, the failing device's predicted peak); `budget_text` is `device_memory` as the user wrote it."""
    from gpipe_tf.memory import suggest
    from gpipe_tf.memory.plan import plan_pipeline

    oom = parse(message)
    constant = None if oom is not None else parse_constant(message)
    if oom is None and constant is None:
        return f"out of memory: {' '.join(message.split())[:300]}; use a smaller batch or more devices"
    found = oom or constant
    shape = "x".join(str(d) for d in found["shape"]) or "scalar"
    size = "" if found["bytes"] is None else f", {human(found['bytes'])}"
    if oom is not None:
        line = f"out of memory on {oom['device']} while allocating a {oom['dtype']} tensor [{shape}]{size}"
        stage_of = find_stage(params, oom["device"])
    else:
        line = (f"out of memory while creating a {constant['dtype']} constant [{shape}]{size} that TensorFlow folded "
                "from a fixed-shape op (reported as 'Cannot parse tensor from proto')")
        stage_of = stage_of_node(params, constant["pipeline"], constant["stage"])
    if stage_of is None:
        return (f"{line}; no pipeline stage runs there (the model's other layers, the input or the optimizer do), "
                "so the memory planner cannot say more: use a smaller batch, or put the model in a pipeline "
                "(--mode=inspect --device_memory=SIZE plans one)")
    path, pipe, replica, stage, replicas = stage_of
    where = f"{path} stage {stage} of {pipe.num_stages}" + (f", replica {replica} of {replicas}" if replicas > 1
                                                              else "")
    try:
        plan = plan_pipeline(pipe, params.train, path, device_memory)
    except ConfigError as e:
        return f"{line} ({where}); the memory planner cannot plan it: {e}"
    predicted = plan["devices"][stage]["peak"]
    line = f"{line} ({where}); the planner predicts a peak of {human(predicted)} on that device"
    budget = device_memory if device_memory is not None else predicted
    hint = suggest.suggest(pipe, params.train, budget, path)
    target = (f"--device_memory={budget_text or device_memory}" if device_memory is not None
              else f"{1 - suggest.HEADROOM:.0%} of that peak on every device")
    if hint is None:
        return f"{line}; no single change or pair of changes fits {target}: more devices or a smaller model"
    advice = f"; smallest change that fits {target}: {hint['change']} (--params={hint['params']})"
    if device_memory is None:
        advice += "; give --device_memory=SIZE (your device's memory) for the change that fits it"
    return line + advice
