"""Batched weight gradients (W) for the loops whose backward runs inside the loop (`windowed_loop.py`).

With `ScheduleOrder.batched_weights`, each stage's matmul weights leave their gradients to a `WeightStash`
(`gpipe_tf/layers/weight_gradients.py`): every micro-batch's backward records, per watched matmul, its input x and
output gradient dy. The loop writes them into TensorArrays that are loop variables made on the stage's device
(one pair per float dtype of the stage's weights), and after the loop, still on that device, each weight's
gradient is one matmul over all micro-batches' pairs: dW = X^T dY. The loop's own sums keep every other part of
the gradients (biases, normalization weights, a weight's non-matmul uses), to which W is added.

Memory: a stage keeps its matmuls' inputs and output gradients of all M micro-batches until the loop ends, as
GPipe keeps its stashes; the gain is time where weights are large and micro-batches small (M matmuls and M
additions into a running sum become one matmul per weight). Gathering a weight's pairs out of the arrays copies
them, and each gather reads only the arrays, so made all at once a device's executor may run every gather before
the first W: a second copy of the whole stash. The W of a device therefore run one weight after another, each
weight's gather waiting for the previous weight's gradient on the device (`_add_weight_gradients`), so one
weight's copy is alive at a time.

The knob's default, "auto", batches exactly the weights for which that memory is small: a weight whose watched
matmuls' inputs and output gradients over all M micro-batches take no more elements than the weight itself
(`worth_batching`), so the stash costs at most one more copy of the weights it computes gradients for, which is
what one micro-batch's weight gradient allocates anyway. Those are the weights whose per-micro-batch gradient is
mostly memory traffic (a gradient matmul of few rows, written and added at the weight's size each micro-batch).
The others keep their gradients per micro-batch. The choice is made from one trace of the stages on a
micro-batch (`auto_selection`), per weight, and logged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from absl import logging
from tensorflow.python.ops import (
    control_flow_util,  # whether a graph is compiled by XLA: no public API says it
    list_ops,  # TensorLists with uninitialized elements: no public API reads them
)

from gpipe_tf.gpipe import orders
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.weight_gradients import MatmulCall, MatmulRecord, WeightStash, weight_gradient

KNOB = "batch_weight_gradients"
AUTO = "auto"
BlockMaker = Callable[[], tf.Tensor]  # makes one row block of a batched W's X or dY (when called, in order)


def define_knob(p: InstantiableParams) -> InstantiableParams:
    """Defines `batch_weight_gradients` (default "auto") on a schedule's Params: FillDrain's and the windowed
    loop's."""
    p.define(KNOB, AUTO, "Compute the weight gradients of matmul weights (Linear layers: projections, attention, "
             "FFN) once per step after each stage's last backward, as one matmul per weight over every micro-batch, "
             "instead of per micro-batch (B/W split with batched W). Faster where weights are large and "
             "micro-batches small; each stage then keeps every micro-batch's matmul inputs and output gradients "
             "until its last backward. True: every matmul weight, and the schedule's order runs W after the last "
             "backward; False: none; 'auto' (default): the weights whose matmuls' inputs and output gradients over "
             "all micro-batches take no more memory than the weight itself, in the schedule's own order.")
    return p


def check_knob(p: InstantiableParams, path: str) -> None:
    """Raises ParamsError unless `batch_weight_gradients` is True, False or "auto"."""
    value = p.get(KNOB)
    if not (isinstance(value, bool) or value == AUTO):
        raise ParamsError(f"{path}.schedule.{KNOB}={value!r} must be True, False or {AUTO!r}: use True to batch "
                          "every matmul weight's gradient after each stage's last backward, False to keep them per "
                          f"micro-batch, or {AUTO!r} (the default) to batch the weights whose stash is no larger "
                          "than the weight")


def apply_knob(order: ScheduleOrder, p: InstantiableParams) -> ScheduleOrder:
    """`order` with its weight gradients batched if the schedule's `batch_weight_gradients` is True ("auto" keeps
    the order: it batches only weights whose stash is small, and their W is no cell of the order)."""
    return orders.with_batched_weights(order) if p.get(KNOB) is True else order


def worth_batching(calls: Sequence[MatmulCall], num_micro_batches: int) -> bool:
    """Whether "auto" batches a weight with these watched matmul calls: every call's rows are static and the
    inputs and output gradients of all of them over `num_micro_batches` micro-batches take no more elements than
    the weight (input_dim x output_dim)."""
    if not calls or any(c.rows is None for c in calls):
        return False
    stash = num_micro_batches * sum(c.rows * (c.input_dim + c.output_dim) for c in calls)
    return stash <= calls[0].input_dim * calls[0].output_dim


def auto_applies(compiled_chunks: Any) -> bool:
    """Whether "auto" may batch anything here: not with XLA stage cells (`compiled_chunks`: a compiled cell watches
    every weight it routes for) nor inside a graph XLA compiles (`train.jit_compile`: the windowed loop's stash
    grows TensorArrays of dynamic size, which XLA stacks as empty)."""
    return compiled_chunks is None and not control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


def auto_selection(calls: Sequence[Sequence[MatmulCall]], num_micro_batches: int,
                   where: str) -> list[frozenset[int]] | None:
    """Per chunk, the indices of the weights "auto" batches (`worth_batching`), from each chunk's watched matmuls
    (`discover_calls` with every weight watched); None when it batches none. Logs the choice (`where` names the
    pipeline's schedule)."""
    chosen, watched = [], 0
    for chunk_calls in calls:
        by_weight: dict[int, list[MatmulCall]] = {}
        for call in chunk_calls:
            by_weight.setdefault(call.weight, []).append(call)
        watched += len(by_weight)
        chosen.append(frozenset(j for j, cs in by_weight.items() if worth_batching(cs, num_micro_batches)))
    count = sum(len(c) for c in chosen)
    logging.info("%s: batch_weight_gradients=%r batches the weight gradients of %d of %d matmul weights (those "
                 "whose inputs and output gradients over M=%d micro-batches take no more memory than the weight)",
                 where, AUTO, count, watched, num_micro_batches)
    return chosen if count else None


class StashLayout:
    """The TensorArrays of each stage's stashed (x, dy) pairs, and where the loop's trace put each record.

    Records are written in the order a stage's gradient builds them, R per dtype group per micro-batch, so the
    pair of record position p in iteration n is element n * R + p of its group's arrays.
    """

    def __init__(self, devices: Sequence[str], stage_weights: Sequence[Sequence[tf.Tensor]]) -> None:
        self.devices = list(devices)
        self.dtypes = [sorted({w.dtype for w in ws if w.dtype.is_floating}, key=lambda d: d.name)
                       for ws in stage_weights]
        # Per stage, from the loop body's trace: (weight index, dtype group, position, input dim, output dim) per
        # record, and the records per iteration of each dtype group.
        self.layout: list[list[tuple[int, int, int, int, int]]] = [[] for _ in self.devices]
        self.counts: list[list[int]] = [[0] * len(d) for d in self.dtypes]

    def empty(self) -> tuple:
        """The loop's initial stashes: per stage, per dtype group, an empty (inputs, output gradients) pair of
        growing TensorArrays on the stage's device."""
        stashes = []
        for device, dtypes in zip(self.devices, self.dtypes):
            with tf.device(device):
                stashes.append(tuple(
                    (tf.TensorArray(d, size=0, dynamic_size=True, infer_shape=False),
                     tf.TensorArray(d, size=0, dynamic_size=True, infer_shape=False)) for d in dtypes))
        return tuple(stashes)

    def keep(self, stage: int, kept: tuple, records: Sequence[MatmulRecord]) -> tuple:
        """`kept` (stage `stage`'s arrays) with this micro-batch's `records` appended; call on the stage's device."""
        groups = list(kept)
        bases = [pair[0].size() for pair in groups]
        counts = [0] * len(groups)
        layout = []
        for record in records:
            if record.x.dtype not in self.dtypes[stage]:
                raise ValueError(f"stage {stage} stashed a matmul in {record.x.dtype.name}, which none of its "
                                 f"weights has ({[d.name for d in self.dtypes[stage]]})")
            g = self.dtypes[stage].index(record.x.dtype)
            xs, dys = groups[g]
            groups[g] = (xs.write(bases[g] + counts[g], record.x), dys.write(bases[g] + counts[g], record.dy))
            layout.append((record.weight, g, counts[g], int(record.x.shape[-1]), int(record.dy.shape[-1])))
            counts[g] += 1
        self.layout[stage], self.counts[stage] = layout, counts
        return tuple(groups)

    def add_weight_gradients(self, kept: Sequence[tuple], sums: Sequence[Sequence[tf.Tensor]],
                             num_micro_batches: int) -> list[tuple[tf.Tensor, ...]]:
        """Per stage, `sums[stage]` (its loop sums) plus each stashed weight's batched gradient from `kept[stage]`
        (its arrays), on the stage's device; a device's W run one weight after another (the module doc)."""
        last_w: dict[str, list[tf.Tensor]] = {}
        out = []
        for stage, device in enumerate(self.devices):
            by_weight: dict[int, tuple[list[BlockMaker], list[BlockMaker]]] = {}
            with tf.device(device), tf.name_scope("batched_weight_gradients"):
                for weight, g, position, in_dim, out_dim in self.layout[stage]:
                    rows = tf.range(num_micro_batches) * self.counts[stage][g] + position
                    xs, dys = kept[stage][g]
                    pair = by_weight.setdefault(weight, ([], []))
                    pair[0].append(_gathered(xs, rows, in_dim))
                    pair[1].append(_gathered(dys, rows, out_dim))
                out.append(tuple(_add_weight_gradients(sums[stage], by_weight, last_w, device)))
        return out


class RoutedStashes:
    """Batched weight gradients for a loop whose backward TensorFlow builds (fill-drain's), where nothing of the
    backward can be collected: each watched matmul's x and dy leave the backward loop as the gradients of two
    TensorLists the forward loop reads placeholders from (`WeightStash` routing).

    Before the loop, one trace of the stages' forward pass on a micro-batch lists each stage's watched matmuls
    (`WeightStash.calls`). Per call, two TensorLists of M uninitialized elements, shaped as x and dy, are made on
    the stage's device; the tape watches them. In iteration i the stage reads element i of each (zeros; nothing is
    stored) and hands them to its matmuls, whose gradients return x and dy in their place, so TensorFlow's loop
    gradient sets element i of each list's gradient. After the backward loop the lists' gradients, stacked, are X
    and dY of all micro-batches, and each weight's gradient is one matmul.
    """

    def __init__(self, job_devices: Sequence[str], stage_weights: Sequence[Sequence[tf.Tensor]],
                 calls: Sequence[Sequence[MatmulCall]], num_micro_batches: int,
                 only: Sequence[frozenset[int]] | None = None) -> None:
        self.devices = list(job_devices)
        self.calls = [list(c) for c in calls]
        self.only = list(only) if only is not None else [None] * len(self.devices)  # per stage, `WeightStash.only`
        self.num_weights = [len(ws) for ws in stage_weights]
        self.lists: list[list[tuple[tf.Tensor, tf.Tensor]]] = []
        for device, stage_calls in zip(self.devices, self.calls):
            with tf.device(device):
                self.lists.append([(_reserve([c.rows, c.input_dim], c.dtype, num_micro_batches),
                                    _reserve([c.rows, c.output_dim], c.dtype, num_micro_batches))
                                   for c in stage_calls])

    @property
    def sources(self) -> list[tf.Tensor]:
        """Every list, flat: what the tape must watch and differentiate with respect to."""
        return [t for stage in self.lists for pair in stage for t in pair]

    def stash(self, stage: int) -> WeightStash | None:
        """A routing stash for stage `stage`, or None if it has no watched matmul."""
        return WeightStash(routes=2 * len(self.calls[stage]), only=self.only[stage]) if self.calls[stage] else None

    def placeholders(self, stage: int, index: tf.Tensor) -> list[tf.Tensor]:
        """Element `index` of each of the stage's lists, in call order (x, dy, x, dy, ...): zeros."""
        out = []
        for call, pair in zip(self.calls[stage], self.lists[stage]):
            for lst, dim in zip(pair, (call.input_dim, call.output_dim)):
                out.append(list_ops.tensor_list_get_item(lst, index, call.dtype, element_shape=[call.rows, dim]))
        return out

    def add_weight_gradients(self, list_gradients: Sequence[Any], sums: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """`sums` (every stage's weight gradients, flat in stage order) plus the batched W computed from the lists'
        gradients (`list_gradients`, in `sources` order), each on its stage's device."""
        out, grads = [], iter(list_gradients)
        start = 0
        last_w: dict[str, list[tf.Tensor]] = {}
        for stage, (device, stage_calls) in enumerate(zip(self.devices, self.calls)):
            by_weight: dict[int, tuple[list[BlockMaker], list[BlockMaker]]] = {}
            stage_sums = sums[start:start + self.num_weights[stage]]
            with tf.device(device), tf.name_scope("batched_weight_gradients"):
                for call in stage_calls:
                    dx_list, dy_list = next(grads), next(grads)
                    if dx_list is None or dy_list is None:
                        continue  # the matmul's output did not reach the loss
                    pair = by_weight.setdefault(call.weight, ([], []))
                    pair[0].append(_stacked(dx_list, call, call.input_dim))
                    pair[1].append(_stacked(dy_list, call, call.output_dim))
                out += _add_weight_gradients(stage_sums, by_weight, last_w, device)
            start += self.num_weights[stage]
        return out


def discover_calls(forward: Callable[[Any, list[WeightStash]], Any], num_stages: int,
                   input_spec: Any) -> list[list[MatmulCall]]:
    """Each stage's watched matmuls (`WeightStash.calls`), from one trace of `forward(x, stashes)` on a
    micro-batch shaped as `input_spec`, where `forward` runs stage s inside `stashes[s].watching(...)`. A stage
    whose matmuls' row counts are not static gets none (its weight gradients stay per micro-batch)."""
    found: list[list[MatmulCall]] = []

    def trace(x: Any) -> list[tf.Tensor]:
        stashes = [WeightStash() for _ in range(num_stages)]
        out = forward(x, stashes)
        found[:] = [stash.calls for stash in stashes]
        return tf.nest.flatten(out)

    tf.function(trace, autograph=False).get_concrete_function(input_spec)
    return [calls if all(c.rows is not None for c in calls) else [] for calls in found]


def _add_weight_gradients(sums: Sequence[tf.Tensor | None],
                          by_weight: dict[int, tuple[list[BlockMaker], list[BlockMaker]]],
                          last_w: dict[str, list[tf.Tensor]], device: str) -> list[tf.Tensor | None]:
    """`sums` (one stage's, on `device`) with weight j's X^T dY added from the blocks its (x, dy) makers in
    `by_weight` make; a None sum (no other gradient) becomes the batched gradient alone. Weight by weight, the
    blocks are made once the device's previous W (`last_w[device]`, updated here) is done, so one weight's copies
    are alive at a time (the module doc)."""
    out = list(sums)
    for j, (x_makers, dy_makers) in sorted(by_weight.items()):
        with tf.control_dependencies(last_w.get(device, [])):
            w = weight_gradient([make() for make in x_makers], [make() for make in dy_makers])
        last_w[device] = [w]
        out[j] = w if out[j] is None else out[j] + tf.cast(w, out[j].dtype)
    return out


def _gathered(array: tf.TensorArray, rows: tf.Tensor, dim: int) -> BlockMaker:
    """Makes the rows `rows` of a stash's array as one [rows x M, dim] block (a copy)."""
    return lambda: tf.reshape(array.gather(rows), [-1, dim])


def _stacked(lst: tf.Tensor, call: MatmulCall, dim: int) -> BlockMaker:
    """Makes a routed list's M elements as one [rows x M, dim] block (a copy)."""
    return lambda: tf.reshape(list_ops.tensor_list_stack(lst, call.dtype, element_shape=[call.rows, dim]), [-1, dim])


def _reserve(shape: list, dtype: tf.DType, size: int) -> tf.Tensor:
    return list_ops.tensor_list_reserve(shape, size, dtype)
