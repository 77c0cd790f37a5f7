"""The micro-batch shapes a GPipe's Params give (TensorFlow-free: experiments read them while resolving)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def micro_batch_shapes(micro_batch_shape: Sequence[Any]) -> tuple[list[list[int]], bool]:
    """(the input shapes, whether there are several) of a GPipe's micro_batch_shape: one shape, or a list of them
    for a pipeline fed several tensors."""
    several = bool(micro_batch_shape) and isinstance(micro_batch_shape[0], (list, tuple))
    return ([list(s) for s in micro_batch_shape] if several else [list(micro_batch_shape)]), several


def batch_rows(micro_batch_shape: Sequence[Any], num_micro_batches: int) -> int:
    """The rows of the whole batch that `num_micro_batches` micro-batches of `micro_batch_shape` make."""
    return micro_batch_shapes(micro_batch_shape)[0][0][0] * num_micro_batches


def rescaled_micro_batch_shape(micro_batch_shape: Sequence[Any], num_micro_batches: int,
                               new_num_micro_batches: int) -> Any:
    """`micro_batch_shape` (one shape or one per input tensor) for the same batch split into
    `new_num_micro_batches` micro-batches instead of `num_micro_batches`; None when the batch does not split."""
    shapes, several = micro_batch_shapes(micro_batch_shape)
    batch = batch_rows(micro_batch_shape, num_micro_batches)
    if batch % new_num_micro_batches:
        return None
    new = [[batch // new_num_micro_batches] + s[1:] for s in shapes]
    return new if several else new[0]
