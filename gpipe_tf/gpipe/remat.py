"""Rematerialization: which stages recompute their forward pass, and the one place that does the recomputing.

Every schedule runs a stage on a micro-batch through `StageForward` and later asks it for the gradient:

* without recomputation, the forward pass is recorded on a tape and its activations stay alive until the
  gradient is taken;
* with recomputation, only the stage's input (and its weights, which the schedules pass as tensors) is kept; the
  gradient runs the stage again, once the output gradient has arrived, and differentiates that.

Why not `tf.recompute_grad` (the API users know): the schedules hand a stage its weights as tensors, so that the
weight gradients come out where the schedule sums them (loop variables on the stage's device; in-place sums),
and `tf.recompute_grad` orders its recomputation after the output gradient by adding a zero computed from that
gradient to every argument. For a stage's weights that is a full copy of them per micro-batch. Ordering by
control dependencies on identities costs nothing.

Why the recomputation differentiates with respect to copies of the weights made in the backward pass: inside the
fill_drain backward loop, a gradient with respect to the forward loop's own weight tensors makes TensorFlow keep
every iteration's weight gradients until the loop ends (one stage's weights' worth of memory per micro-batch, so
the peak would grow with M; `tests/pipeline/test_pipeline.py` checks that the backward loop stashes nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe.leaves import float_leaves, with_float_leaves
from gpipe_tf.gpipe.xla_cells import BoundCell
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.weight_gradients import MatmulCall, MatmulRecord, WeightStash

POLICIES = ("never", "always", "except_last")

StageFn = Callable[[Sequence[tf.Tensor], Any], Any]


def stage_uses_remat(policy: str, stage: int, num_stages: int) -> bool:
    """Whether `stage` recomputes under `policy`.

    always: every stage keeps only its input per micro-batch; except_last: all but the last stage, whose
    backward starts right after its forward in GPipe's schedule, so recomputing it would save nothing.
    """
    if policy not in POLICIES:
        raise ParamsError(f"remat={policy!r} is not one of {POLICIES}")
    return policy == "always" or (policy == "except_last" and stage < num_stages - 1)


class StageForward:
    """One stage's forward pass on one micro-batch, and what its gradient needs.

    `fn(weights, inputs)` runs the stage; `inputs` may be any nested structure, of which only the floating-point
    leaves get gradients, and only if `input_gradient` (stage 0 on a data batch needs none).

    With XLA cells (`fn` an `xla_cells.BoundCell`) and a recording stash, the cell routes: the stage's weights get
    a pair of zero placeholders per watched matmul, and the gradients the cell returns for them become the stash's
    records when the gradient is taken (`xla_cells` module doc).
    """

    def __init__(self, fn: StageFn, weights: Sequence[tf.Tensor], inputs: Any, input_gradient: bool,
                 recompute: bool, stash: WeightStash | None = None) -> None:
        self.fn, self.weights, self.inputs = fn, list(weights), inputs
        self.input_gradient, self.recompute, self.stash = input_gradient, recompute, stash
        self.records_to: WeightStash | None = None  # the recording stash a routing cell's pairs go to
        self.calls: list[MatmulCall] = []  # the matmuls a routing cell routes for it
        if isinstance(fn, BoundCell) and stash is not None and not stash.routes:
            self.calls = fn.matmul_calls(self.weights, inputs)
            self.records_to = stash if self.calls else None
            self.stash = WeightStash(routes=2 * len(self.calls)) if self.calls else None
            self.weights += _placeholders(self.calls)
        if recompute:
            self.tape, self.xs = None, []
            self.outputs = self._run(self.weights, inputs)
        else:
            self.outputs, self.tape, self.xs = self._recorded(self.weights, self._input_floats())

    def _input_floats(self) -> list[tf.Tensor]:
        return float_leaves(self.inputs) if self.input_gradient else []

    def _recorded(self, weights: list[tf.Tensor], xs: list[tf.Tensor]) -> tuple[Any, tf.GradientTape, list]:
        # Fresh identities: if the input holds one tensor twice, e.g. (x, x), each position gets its own gradient.
        fresh = [tf.identity(t) for t in xs]
        tape = tf.GradientTape(watch_accessed_variables=False, persistent=True)
        with tape:
            tape.watch(fresh + weights)
            out = self._run(weights, with_float_leaves(self.inputs, fresh) if self.input_gradient else self.inputs)
        return out, tape, fresh

    def _run(self, weights: list[tf.Tensor], inputs: Any) -> Any:
        if self.stash is None:
            return self.fn(weights, inputs)
        if isinstance(self.fn, BoundCell):  # the cell watches its weights itself
            return self.fn(weights, inputs, self.stash.routes)
        with self.stash.watching(weights):
            return self.fn(self.stash.weights(weights), inputs)

    def gradient(self, dys: Sequence[tf.Tensor], after: Sequence[Any] = ()) -> tuple[list[tf.Tensor],
                                                                                     list[tf.Tensor]]:
        """(input gradients, weight gradients) given `dys`, the gradients of the output's float leaves.

        With a `stash`, the matmuls of watched weights leave their weight gradients to it (as `MatmulRecord`s
        appended while this gradient is built), and a weight with no other use gets None here, not zeros (with XLA
        cells, zeros).

        Nothing of it starts before `dys` and `after` (ops or tensors) exist: a recomputation runs only once it
        is needed, so TensorFlow cannot merge it with the forward pass, and its activations live only meanwhile.
        """
        dys = list(dys)
        if not self.recompute:
            with tf.control_dependencies(list(after)):
                grads = self._gradient(self.tape, float_leaves(self.outputs), self.xs, self.weights, dys)
            return grads[:len(self.xs)], self._deliver(grads[len(self.xs):])
        if isinstance(self.fn, BoundCell):
            # XLA: the recompute and its gradient in one compiled cell that takes `dys` as inputs (a recompute
            # ordered by control dependencies alone is one XLA would drop); placeholders made here, as below.
            routes = self.stash.routes if self.stash is not None else 0
            real = self.weights[:len(self.weights) - routes]
            weights = real + [tf.zeros(p.shape, p.dtype) for p in self.weights[len(real):]]
            with tf.control_dependencies(list(after)):
                dx, dw = self.fn.gradient(weights, self.inputs, self.input_gradient, dys, routes)
            return dx, self._deliver(dw)
        with tf.control_dependencies(list(after) + dys):
            # Copies made here: differentiating with respect to the forward pass's own weight tensors made
            # TensorFlow keep every micro-batch's weight gradients in the fill_drain backward loop.
            # A routing stash's placeholders are zeros made here, so that no forward tensor waits for them.
            real = self.weights if self.stash is None else self.stash.weights(self.weights)
            weights = [tf.identity(w) for w in real] + [tf.zeros(p.shape, p.dtype) for p in self.weights[len(real):]]
            out, tape, xs = self._recorded(weights, self._input_floats())
        grads = self._gradient(tape, float_leaves(out), xs, weights, dys)
        return grads[:len(xs)], grads[len(xs):]

    def _deliver(self, dw: list[tf.Tensor]) -> list[tf.Tensor]:
        """`dw` as the caller's weights have it: where a routing cell stands in for a recording stash, its
        placeholders' gradients (x, dy per watched matmul) become that stash's records and leave the list."""
        if self.records_to is None:
            return dw
        num_real = len(dw) - 2 * len(self.calls)
        pairs = dw[num_real:]
        self.records_to.records.extend(MatmulRecord(call.weight, x, dy)
                                       for call, x, dy in zip(self.calls, pairs[0::2], pairs[1::2]))
        return dw[:num_real]

    def _gradient(self, tape: tf.GradientTape, outputs: list[tf.Tensor], xs: list[tf.Tensor],
                  weights: list[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor | None]:
        unconnected = tf.UnconnectedGradients.ZERO if self.stash is None else tf.UnconnectedGradients.NONE
        grads = tape.gradient(outputs, xs + weights, output_gradients=dys, unconnected_gradients=unconnected)
        return [tf.zeros_like(x) if g is None else g for g, x in zip(grads[:len(xs)], xs)] + grads[len(xs):]


def _placeholders(calls: Sequence[MatmulCall]) -> list[tf.Tensor]:
    """Zeros shaped as each watched matmul's input and output gradient, in call order (x, dy, x, dy, ...)."""
    out = []
    for call in calls:
        out += [tf.zeros([call.rows, call.input_dim], call.dtype), tf.zeros([call.rows, call.output_dim], call.dtype)]
    return out


def stage_op(fn: StageFn, weights: Sequence[tf.Tensor], inputs: Any, input_gradient: bool, recompute: bool,
             device: str, stash: WeightStash | None = None) -> Any:
    """Runs `fn(weights, inputs)` as one op whose gradient (a `StageForward.gradient`) runs on `device`.

    For schedules whose backward TensorFlow builds (the gradient of a while loop): the op's gradient is the
    stage's whole backward, recomputation included, so it stays one unit on the stage's device. With a routing
    `stash`, `weights` ends with its placeholders (`WeightStash.weights` strips them for `fn`), and their gradients
    are the watched matmuls' inputs and output gradients; a watched weight's own gradient is then None.
    """
    floats = float_leaves(inputs) if input_gradient else []
    num_x = len(floats)
    structure: list[Any] = []

    @tf.custom_gradient
    def op(*args: tf.Tensor) -> Any:
        xs, ws = list(args[:num_x]), list(args[num_x:])
        stage = StageForward(fn, ws, with_float_leaves(inputs, xs) if input_gradient else inputs, input_gradient,
                             recompute, stash)
        structure.append(stage.outputs)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            with tf.device(device):
                dx, dw = stage.gradient(dys)
            return list(dx) + list(dw)

        return float_leaves(stage.outputs), grad

    float_out = op(*floats, *weights)
    return with_float_leaves(structure[0], float_out)
