"""`train.jit_compile`: the whole training step as one XLA program, and what it refuses.

A compiled function runs on one device, ignores `tf.device` inside it and cannot read another device's variables
(TensorFlow's XLA known issues, "tf.Variable on a different device"; TensorFlow issue 124880), so the whole step
compiles only where every variable of the task and the optimizer is on one device: K=1, or every stage on one
device. A pipeline over several devices compiles each stage on its own device instead (the GPipe layer's
`jit_compile`, `gpipe_tf/gpipe/xla_cells.py`).

XLA gets some constructs wrong without an error. This module refuses them while the step is traced, before any of
it runs:

* a `tf.TensorArray` of dynamic size: XLA returns an empty stack or fails to compile (`batch_weight_gradients`
  in the windowed-loop schedules collects its matmul operands in such arrays);
* rematerialization ordered by control dependencies (a GPipe layer with remat and without its own
  `jit_compile`): XLA ignores control dependencies and merges the recompute with the forward pass (measured in
  the optimized HLO of a whole unrolled or 1F1B step: not one recompute matmul left), so the step would run but
  keep every activation the remat policy promises to drop. The stage cells' backward makes the recompute depend
  on a value of the output gradient, as `tf.recompute_grad` does, and it stays
  (`tests/training/test_xla_step.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.pipeline import GPipe


def _device(name: str) -> str:
    """A variable's device, short for this process's own ('/device:CPU:0'), whole for another process's (each
    TensorFlow worker's CPU:0 is its own device)."""
    spec = tf.DeviceSpec.from_string(name)
    process = ("" if spec.job in (None, "localhost")
               else f"/job:{spec.job}/replica:{spec.replica or 0}/task:{spec.task or 0}")
    return f"{process}/device:{spec.device_type or 'CPU'}:{spec.device_index or 0}"


def check_one_device(variables: Iterable[tf.Variable], modules: Iterable[tf.Module]) -> None:
    """Raises ConfigError unless every variable is on one device and no pipeline remats by control dependencies."""
    devices = sorted({_device(v.device) for v in variables})
    if len(devices) > 1:
        raise ConfigError(
            f"train.jit_compile=True compiles the whole step as one XLA program on one device, but the task's "
            f"variables are on {len(devices)} devices ({', '.join(devices)}): put every stage on one device "
            "(--params=task.network.num_stages=1), or compile each stage on its own device with "
            "--params=task.network.jit_compile=True and train.jit_compile=False")
    for module in modules:
        if isinstance(module, GPipe) and not module.p.jit_compile and any(module.plan.remat):
            path = params_path(module.path)
            raise ConfigError(
                f"train.jit_compile=True with {path}.remat={module.p.remat!r}: XLA drops a recompute that control "
                f"dependencies order, so the step would keep every activation; set {path}.jit_compile=True (its "
                f"backward cells make the recompute depend on the output gradient, which XLA keeps) or "
                f"{path}.remat='never'")


def params_path(layer_path: str) -> str:
    """The Params path a user overrides for the layer at `layer_path` ('classifier/network' -> 'task.network'):
    the task's layers are its Params fields of the same names."""
    return ".".join(["task"] + layer_path.split("/")[1:])


def refuse_uncompilable(graph: tf.Graph) -> None:
    """Raises ConfigError if `graph` or a function it calls writes a TensorArray of dynamic size (XLA would stack
    none of its elements). In a `tf.function` such an array is a TensorList whose writes may grow it."""
    definition = graph.as_graph_def()
    nodes = list(definition.node) + [n for f in definition.library.function for n in f.node_def]
    for node in nodes:
        if node.op == "TensorListSetItem" and node.attr["resize_if_index_out_of_bounds"].b:
            raise ConfigError(
                f"train.jit_compile=True: the step writes a TensorArray of dynamic size ({node.name}), which XLA "
                "stacks as empty without an error; turn off what makes it (batch_weight_gradients on a 1F1B, "
                "Interleaved or zero-bubble schedule) or set train.jit_compile=False")


def compilable_batch(batch: Any) -> Any:
    """`batch` without its string features (raw text for decoding), which XLA cannot take as inputs; a training
    step reads only its numbers."""
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if not (isinstance(v, tf.Tensor) and v.dtype == tf.string)}
    return batch
