"""Weight gradients that a pipeline may compute later, batched over micro-batches (the W of a B/W split).

A layer whose weight enters through a matmul calls `matmul(x, w)` instead of `tf.matmul`. Outside a
`WeightStash` it is `tf.matmul` over the last dimension of `x`. Inside one (a schedule watching a stage's weights
with `WeightStash.watching`), for a watched weight `w`, its gradient computes only the input gradient,
dx = dy w^T (B), and records the pair (x, dy) in the stash instead of adding x^T dy into `w`'s gradient. The
schedule then keeps the pairs of every micro-batch on the stage's device and computes each weight's gradient once,
dW = X^T dY over the pairs of all micro-batches concatenated along the rows (W): one matmul per weight, where
the per-micro-batch gradient costs M matmuls and M additions into the running sum.

A weight the stash does not watch (a cast copy under mixed precision, a weight of another stage) and any other
use of a watched weight (a bias, a shared embedding) take their ordinary gradient: the tape still returns those
parts, and the schedule adds the batched part to them. Nothing here depends on the pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence

import tensorflow as tf

from gpipe_tf.layers import matmul_layout

_ACTIVE = threading.local()  # .stashes: the stashes being watched while a stage's forward is built


@dataclasses.dataclass(frozen=True)
class MatmulRecord:
    """One watched matmul's operands for the weight gradient: dW[weight] += x^T dy.

    Attributes:
      weight: the index of the weight in the list the stash watched.
      x: the matmul's input, [rows, input_dim].
      dy: the gradient of its output, [rows, output_dim].
    """

    weight: int
    x: tf.Tensor
    dy: tf.Tensor


@dataclasses.dataclass(frozen=True)
class MatmulCall:
    """One watched matmul as the forward pass made it: its weight and its operands' shapes.

    Attributes:
      weight: the index of the weight in the list the stash watched.
      rows: rows of its input after flattening the leading dimensions (None if not known when traced).
      input_dim, output_dim: the weight's shape.
      dtype: the operands' dtype.
    """

    weight: int
    rows: int | None
    input_dim: int
    output_dim: int
    dtype: tf.DType


class WeightStash:
    """Watches a stage's weights: their matmuls leave the weight gradient to the caller, in one of two ways.

    `watching(weights)` marks `weights` (the tensors a stage's layers get as their theta) for the `matmul` calls
    made inside it, each listed in `calls` as it is made; with `only`, just the weights at those indices (the
    others take their ordinary gradient). Recording (the default): each gradient of such a matmul
    appends a `MatmulRecord` (x, dy) to `records`, in the order the gradient is built, for a schedule that builds
    its backward itself. Routing (`routes` > 0, for a backward TensorFlow builds, where nothing can be collected):
    the last `routes` tensors of the watched list are pairs of placeholders (zeros shaped as x and as dy, two per
    matmul call in call order); the n-th call takes the n-th pair as extra inputs and its gradient returns x and dy
    as their "gradients", so that they reach whatever the placeholders were read from.
    """

    def __init__(self, routes: int = 0, only: frozenset[int] | None = None) -> None:
        if routes % 2:
            raise ValueError(f"WeightStash(routes={routes}): routes come in pairs (x, dy), give an even number")
        self.routes = routes
        self.only = only  # the indices of the watched weights it defers; None: all
        self.records: list[MatmulRecord] = []
        self.calls: list[MatmulCall] = []
        self._index: dict = {}
        self._pairs: list[tuple[tf.Tensor, tf.Tensor]] = []

    def weights(self, watched: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The weights of a watched list: all but its trailing `routes` placeholders."""
        return list(watched[:len(watched) - self.routes])

    @contextlib.contextmanager
    def watching(self, watched: Sequence[tf.Tensor]) -> Iterator[WeightStash]:
        """Within this block, `matmul(x, w)` with `w` = `self.weights(watched)[j]` defers its weight gradient to this
        stash as weight j (and takes the next pair of placeholders when routing)."""
        weights = self.weights(watched)
        placeholders = list(watched[len(weights):])
        self._index = {w.ref(): j for j, w in enumerate(weights) if self.only is None or j in self.only}
        self._pairs = [(placeholders[n], placeholders[n + 1]) for n in range(0, len(placeholders), 2)]
        self.calls = []  # this block's calls, kept after it
        stack = _stashes()
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()
            self._index, self._pairs = {}, []
        if self.routes and len(self.calls) != self.routes // 2:
            raise ValueError(f"the stage made {len(self.calls)} watched matmuls where {self.routes // 2} were traced "
                             "before: its layers must make the same matmuls in every call")

    def weight_index(self, w: tf.Tensor) -> int | None:
        """The position of `w` in the watched weights, or None if this stash does not watch it."""
        return self._index.get(w.ref()) if isinstance(w, tf.Tensor) else None

    def _route(self) -> tuple[tf.Tensor, ...]:
        n = len(self.calls) - 1
        if not self.routes:
            return ()
        if n >= len(self._pairs):
            raise ValueError(f"the stage made more watched matmuls than the {len(self._pairs)} traced before: its "
                             "layers must make the same matmuls in every call")
        return self._pairs[n]


def _stashes() -> list[WeightStash]:
    if not hasattr(_ACTIVE, "stashes"):
        _ACTIVE.stashes = []
    return _ACTIVE.stashes


def _as_rows(x: tf.Tensor, in_dim: int) -> tf.Tensor:
    """x [..., in_dim] as [rows, in_dim], rows static where x's leading dimensions are."""
    flat = tf.reshape(x, [-1, in_dim])
    flat.set_shape([x.shape[:-1].num_elements(), in_dim])
    return flat


def _from_rows(y: tf.Tensor, x: tf.Tensor, out_dim: int) -> tf.Tensor:
    """y [rows, out_dim] back in x's leading dimensions: [..., out_dim]."""
    out = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [out_dim]], 0))
    out.set_shape(x.shape[:-1].concatenate([out_dim]))
    return out


def matmul(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """x @ w over the last dimension of `x` (any rank >= 2), `w` of shape [input_dim, output_dim].

    Inside a `WeightStash.watching` block that watches `w`, the weight gradient of this product is left to the
    stash (see the module doc); elsewhere this is `matmul_layout.forward` on x's rows.
    """
    stashes = _stashes()
    stash = stashes[-1] if stashes else None
    j = stash.weight_index(w) if stash is not None else None
    in_dim, out_dim = int(w.shape[0]), int(w.shape[1])
    if j is None:
        return _from_rows(matmul_layout.forward(_as_rows(x, in_dim), w), x, out_dim)
    rows = x.shape[:-1].num_elements()
    stash.calls.append(MatmulCall(j, rows, in_dim, out_dim, w.dtype))
    route = stash._route()

    # w is an argument so that the tape records this op whenever the weight is watched (a first layer's input
    # need not be); its gradient through this op is None: the stash holds it.
    @tf.custom_gradient
    def deferred(x_arg: tf.Tensor, w_arg: tf.Tensor, *placeholders: tf.Tensor) -> tuple[tf.Tensor, object]:
        flat = _as_rows(x_arg, in_dim)
        y = matmul_layout.product(flat, w_arg)  # the layout's ops; the gradient is this function's

        def grad(dy: tf.Tensor) -> tuple:
            dy_rows = tf.reshape(dy, [-1, out_dim])
            dx = tf.reshape(tf.matmul(dy_rows, w_arg, transpose_b=True), tf.shape(x_arg))
            if placeholders:  # routing: x and dy leave as the placeholders' gradients
                # x as an op of the gradient's own graph: a function's gradient (an XLA cell's) cannot return a
                # tensor of its forward graph unchanged.
                return dx, None, tf.identity(flat), dy_rows
            stash.records.append(MatmulRecord(j, flat, dy_rows))
            return dx, None

        return _from_rows(y, x_arg, out_dim), grad

    return deferred(x, w, *route)


def weight_gradient(xs: Sequence[tf.Tensor], dys: Sequence[tf.Tensor]) -> tf.Tensor:
    """X^T dY with the row blocks `xs` ([rows_n, input_dim]) and `dys` ([rows_n, output_dim]) concatenated:
    the sum over n of xs[n]^T dys[n], as one matmul."""
    x = xs[0] if len(xs) == 1 else tf.concat(list(xs), axis=0)
    dy = dys[0] if len(dys) == 1 else tf.concat(list(dys), axis=0)
    return tf.matmul(x, dy, transpose_a=True)
