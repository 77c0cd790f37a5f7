"""XLA stage cells: each chunk's forward and backward compiled by XLA, run on the chunk's own device.

A compiled function runs on one device and cannot read another device's variables, and `tf.device` inside it is
ignored without a word (TensorFlow's XLA known issues, "tf.Variable on a different device"; TensorFlow issue
124880), so a multi-device step cannot be compiled whole. What works is what this module builds: per chunk, compiled
cells called under the chunk's device from the schedule's ordinary loop. The loops, token rings, TensorArrays, the
loss head and the optimizer stay in TensorFlow; the cells get the chunk's weights as tensors (read on the chunk's
device by the pipeline), never its variables.

* **Forward cell** `(weights, inputs, seed) -> (outputs, aux statistics)`. Without remat the schedules record it
  on a tape: TensorFlow's gradient of a compiled function is itself compiled (its forward returns the
  activations the backward needs), so the backward is a second XLA program on the same device.
* **Backward cell** `(weights, inputs, seed, output gradients) -> (input gradients, weight gradients)` for a
  rematerializing chunk: the forward pass recomputed and differentiated in one compiled program, its inputs made
  to depend on a value of the output gradient (`_after`, as `tf.recompute_grad` does). XLA ignores control
  dependencies: a recompute ordered by them alone is merged with the forward pass once both are in one program
  (the whole step under `train.jit_compile`); this one cannot be, and runs only once the gradient exists.

* **Batched weight gradients** (`batch_weight_gradients`): a compiled cell cannot hand out what its backward
  builds, so a cell routes instead. It takes, after the chunk's weights, a pair of placeholders per watched matmul
  (zeros shaped as the matmul's input x and output gradient dy, `matmul_calls` lists them) and watches the
  weights inside itself (`WeightStash` routing); the gradients it returns for the placeholders are x and dy, and
  those of the watched weights leave out x^T dy. The schedule's stash gets them from there (`remat.StageForward`).

A cell is traced once per chunk and input signature, so an unrolled schedule compiles one program per chunk and
direction, not one per micro-batch. The micro-batch's seed is an argument, not a captured tensor, for that
reason. Dropout masks inside the cells are the ones drawn without XLA: the layers draw them with
`layers/stateless_random.py`, whose values XLA does not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import batched_weights
from gpipe_tf.gpipe.leaves import float_leaves, with_float_leaves
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.weight_gradients import MatmulCall, WeightStash

# run_chunk(chunk, weights, inputs, ctx) -> outputs, as `PipelineJob.run_chunk`.
RunChunk = Callable[[int, Sequence[tf.Tensor], Any, FPropContext], Any]


class CompiledChunk:
    """The forward and backward cells of one chunk, traced once per input signature; `bind` gives a micro-batch's
    stage function."""

    def __init__(self, run_chunk: RunChunk, chunk: int, training: bool) -> None:
        self.run_chunk, self.chunk, self.training = run_chunk, chunk, training
        self.forward_cell = tf.function(self._forward, jit_compile=True, autograph=False)
        self.backward_cell = tf.function(self._backward, jit_compile=True, autograph=False)

    def matmul_calls(self, weights: Sequence[tf.Tensor], inputs: Any, seed: Any) -> list[MatmulCall]:
        """The chunk's matmuls of `weights` (`weight_gradients.matmul`) on inputs shaped as `inputs`, from one
        uncompiled trace (`batched_weights.discover_calls`); none if a matmul's row count is not static (no
        placeholder can be shaped for it: its weight gradient then stays per micro-batch)."""
        def forward(x: Any, stashes: list[WeightStash]) -> Any:
            with stashes[0].watching(weights):
                return self.run_chunk(self.chunk, weights, x, self._context(seed, collect_aux=False))

        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)
        return batched_weights.discover_calls(forward, 1, spec)[0]

    def bind(self, ctx: FPropContext) -> BoundCell:
        """The stage function of one micro-batch of context `ctx` (its seed; its aux dict, if it collects)."""
        return BoundCell(self, ctx)

    def _context(self, seed: Any, collect_aux: bool) -> FPropContext:
        return FPropContext(training=self.training, seed=seed, aux={} if collect_aux else None)

    def _forward(self, weights: list[tf.Tensor], inputs: Any, seed: Any, collect_aux: bool,
                 routes: int) -> tuple[Any, dict]:
        ctx = self._context(seed, collect_aux)
        with _watching(weights, routes) as real:
            outputs = self.run_chunk(self.chunk, real, inputs, ctx)
        return outputs, dict(ctx.aux or {})

    def _backward(self, weights: list[tf.Tensor], inputs: Any, seed: Any, input_gradient: bool,
                  dys: list[tf.Tensor], routes: int) -> list[tf.Tensor]:
        # The statistics a recompute reports were reported by its forward already: none are collected here.
        ctx = self._context(seed, collect_aux=False)
        num_real = len(weights) - routes
        real, inputs = _after(dys, list(weights[:num_real]), inputs)
        weights = real + list(weights[num_real:])
        xs = [tf.identity(t) for t in float_leaves(inputs)] if input_gradient else []
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(xs + list(weights))
            with _watching(weights, routes) as real:
                outputs = self.run_chunk(self.chunk, real, with_float_leaves(inputs, xs) if input_gradient else inputs,
                                         ctx)
        grads = tape.gradient(float_leaves(outputs), xs + list(weights), output_gradients=dys,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return list(grads)


class BoundCell:
    """One micro-batch's stage function on compiled cells: `cell(weights, inputs)` runs the forward cell (and puts
    the statistics it reports in the micro-batch's aux dict); `gradient` runs the backward cell."""

    def __init__(self, compiled: CompiledChunk, ctx: FPropContext) -> None:
        self.compiled, self.ctx = compiled, ctx

    def __call__(self, weights: Sequence[tf.Tensor], inputs: Any, routes: int = 0) -> Any:
        """The chunk's outputs on `inputs` from the compiled forward cell; `weights` ends with `routes` placeholders
        of watched matmuls (the module doc)."""
        outputs, aux = self.compiled.forward_cell(list(weights), inputs, self.ctx.seed, self.ctx.aux is not None,
                                                  routes)
        if self.ctx.aux is not None:
            self.ctx.aux.update(aux)
        return outputs

    def gradient(self, weights: Sequence[tf.Tensor], inputs: Any, input_gradient: bool,
                 dys: Sequence[tf.Tensor], routes: int = 0) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """(input gradients, weight gradients) of the chunk at `inputs` given its output gradients `dys`, the
        forward recomputed inside the compiled backward cell; the gradients of `routes` trailing placeholders
        are the watched matmuls' inputs and output gradients."""
        grads = self.compiled.backward_cell(list(weights), inputs, self.ctx.seed, input_gradient, list(dys), routes)
        num_x = len(float_leaves(inputs)) if input_gradient else 0
        return grads[:num_x], grads[num_x:]

    def matmul_calls(self, weights: Sequence[tf.Tensor], inputs: Any) -> list[MatmulCall]:
        """The chunk's watched matmuls on `inputs` (`CompiledChunk.matmul_calls`)."""
        return self.compiled.matmul_calls(weights, inputs, self.ctx.seed)


@contextlib.contextmanager
def _watching(weights: list[tf.Tensor], routes: int) -> Iterator[list[tf.Tensor]]:
    """The chunk's weights (`weights` without its `routes` trailing placeholders), watched by a routing stash
    within the block if `routes`."""
    if not routes:
        yield weights
        return
    stash = WeightStash(routes)
    with stash.watching(weights):
        yield stash.weights(weights)


def _after(dys: Sequence[tf.Tensor], weights: list[tf.Tensor], inputs: Any) -> tuple[list[tf.Tensor], Any]:
    """`weights` and `inputs` made to depend on the output gradients' values while unchanged, so that the recompute
    cannot start before them nor be merged with the forward pass once the cell is inlined into a larger program
    (the whole step under `train.jit_compile`, where XLA would otherwise take the forward's activations for the
    recompute's and keep them all). As `tf.recompute_grad` does: a zero that XLA cannot fold, since it comes from a
    value of the gradient (NaN where that value is NaN, as the gradient then is), added to the float inputs, or
    where the chunk has none (token ids) to its smallest weight."""
    first = tf.reshape(dys[0], [-1])[:1] if dys else tf.zeros([1])
    present = tf.cast(tf.reduce_max(first), tf.bool)
    zero = tf.where(tf.equal(present, present), 0.0, float("nan"))
    floats = float_leaves(inputs)
    if floats:
        return weights, with_float_leaves(inputs, [x + tf.cast(zero, x.dtype) for x in floats])
    if weights:
        j = min(range(len(weights)), key=lambda i: weights[i].shape.num_elements() or 0)
        weights = weights[:j] + [weights[j] + tf.cast(zero, weights[j].dtype)] + weights[j + 1:]
    return weights, inputs
