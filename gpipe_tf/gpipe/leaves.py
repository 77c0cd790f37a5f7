"""Leaves of the nested structures that cross pipeline stages: which are differentiable, and where they come from.

A stage boundary may be any nested structure of tensors; only its floating-point leaves carry gradients (ids,
labels and masks pass along without one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def is_float(t: tf.Tensor) -> bool:
    """Whether `t` can carry a gradient (floating point or complex)."""
    return t.dtype.is_floating or t.dtype.is_complex


def float_leaves(structure: Any) -> list[tf.Tensor]:
    """The differentiable leaves of a nested structure, in order."""
    return [t for t in tf.nest.flatten(structure) if is_float(t)]


def with_float_leaves(structure: Any, floats: Sequence[tf.Tensor]) -> Any:
    """`structure` with its differentiable leaves replaced by `floats`, in order."""
    it = iter(floats)
    return tf.nest.pack_sequence_as(structure, [next(it) if is_float(t) else t for t in tf.nest.flatten(structure)])


_VARIABLE_OPS = {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VarHandleOp", "VariableV2"}


def depends_on_variables(tensors: Sequence[tf.Tensor], max_ops: int = 10000) -> bool:
    """Whether any of `tensors` is computed from a variable (so its gradient can matter), in graph mode.

    Walks the producing ops backwards. Function arguments and constants (input batches) end the walk; eagerly,
    or when the graph is too large to walk, the answer is conservatively True.
    """
    if tf.executing_eagerly():
        return bool(tensors)
    seen: set[int] = set()
    stack = []
    for t in tensors:
        try:
            stack.append(t.op)
        except AttributeError:  # an eager tensor captured by the function: a constant
            continue
    while stack:
        op = stack.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        if op.type in _VARIABLE_OPS or len(seen) > max_ops:
            return True
        if op.type == "Placeholder" and op.outputs[0].dtype == tf.resource:
            return True
        stack.extend(t.op for t in op.inputs)
    return False
