"""The task's loss head in the memory plan: the layers a task runs on its pipelined network's output (the output
softmax), on the device of the pipeline's last chunk, which runs them (`BaseTask.network_and_head`) and holds their
variables (`BaseTask.create_head`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import InstantiableParams, Params
from gpipe_tf.layers.base_layer import BaseLayer, inherited_dtypes, with_inherited_dtypes


@dataclasses.dataclass(frozen=True)
class Head:
    """The loss head of one pipeline: its layers as (Params path, layer Params stating their dtypes)."""

    layers: tuple[tuple[str, InstantiableParams], ...] = ()


NO_HEAD = Head()  # a pipeline whose output feeds no planned head


def task_head(task: Params, path: str, root: str = "task") -> Head:
    """The head that the task Params `task` (at `root`) runs on the pipeline at `path`: its `head_params` when
    `path` is the task's own network (`{root}.network`), else none (a pipeline deeper in the tree feeds layers the
    planner does not see)."""
    cls = getattr(task, "cls", None)
    if path != f"{root}.network" or not (isinstance(cls, type) and hasattr(cls, "head_params")):
        return NO_HEAD
    dtype, fprop_dtype = inherited_dtypes(task)
    return Head(tuple((f"{root}.{name}", with_inherited_dtypes(lp, dtype, fprop_dtype))
                      for name, lp in cls.head_params(task)))


def head_memory(head: Head, features: Any, runs: int) -> tuple[tuple[int, ...], int]:
    """(each head layer's parameter count, the bytes its work holds at once) for a head applied to `runs`
    micro-batches of `features` (the pipeline's output spec) at once: each layer's `loss_bytes`, plus a copy of its
    weights in the compute dtype under mixed precision."""
    counts, held = [], 0
    for path, lp in head.layers:
        cls = lp.cls
        if not (isinstance(cls, type) and issubclass(cls, BaseLayer)):
            raise ConfigError(f"memory plan: the loss head {path} is not a layer's Params ({cls!r})")
        try:
            count = int(cls.num_params(lp))
            work = int(cls.loss_bytes(lp, features))
        except NotImplementedError as e:
            raise ConfigError(f"memory plan: the loss head {path} ({cls.__name__}) cannot estimate its memory from "
                              f"Params ({e}); implement num_params and activation_bytes, or plan without "
                              "--device_memory") from None
        variable, compute = tf.as_dtype(lp.dtype), tf.as_dtype(lp.fprop_dtype)
        cast = count * compute.size if compute != variable else 0
        counts.append(count)
        held += runs * work + cast
    return tuple(counts), held
