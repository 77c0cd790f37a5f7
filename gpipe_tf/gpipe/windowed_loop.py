"""The loop of the schedules whose loss runs inside the pipeline (1F1B, Interleaved, ZeroBubble, ZeroBubbleV): every
micro-batch's forward, loss and backward in one while loop over the job's chunks (`orders.py` defines stage, chunk
and lap), ordered by the schedule's order data (`orders.ScheduleOrder`'s `in_flight` windows, `forward_waits` and
`backward_waits`), a graph constant in M.

How, as one while loop:

* Iteration i is micro-batch i's whole journey: the forward of every chunk, the loss, the backward of every chunk,
  each chunk's part under its device and name scope (``forward``, ``loss``, ``backward``), each chunk's weight
  gradients summed into loop variables on its device. A chunk's stashes are tensors of one iteration, so
  TensorFlow frees them as soon as that iteration's backward has used them; no tape spans iterations.
* A device runs the iterations' ops as their inputs arrive (`parallel_iterations` is M), so chunk 0 starts
  micro-batch i+1 while chunk 1 runs micro-batch i, as in fill-drain; what orders forwards and backwards is the
  order data, as rings of tokens, loop variables on the chunk's device: with `in_flight[c]` = w, chunk c has a
  ring of w tokens and its forward of micro-batch i waits for the token its backward of micro-batch i - w
  produced, so it never holds more than w micro-batches' stashes. Under an unsplit order (W with its B) a chunk's
  backward of micro-batch i waits until micro-batch i - 1's weight gradients are in the sums, so no layer's next
  weight gradient is computed early beside the previous one and the sum. A `forward_waits` entry (c, t, lag) is a ring
  of `lag` tokens filled by chunk t's forwards and read by chunk c's: F(c, i) waits for F(t, i - lag). A
  `backward_waits` entry (c, t, lag) is a ring of `lag` tokens filled by chunk t's backwards (the token its own
  ring gets) and read by chunk c's forwards: F(c, i) waits for B(t, i - lag).
* The While op, the loop's counter and its condition (its iteration count) sit on this process's CPU, as in
  fill-drain (`fill_drain.py` says why); the counters that index micro-batches start on the chunks that use them.
* The pipeline is one `tf.custom_gradient` op whose forward already computed the gradients (seeded with the
  loss's gradient seed, `PipelineLoss.gradient_seed`); its gradient function only rescales them by the caller's
  upstream gradient, on each chunk's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from gpipe_tf.gpipe import batched_weights, fill_drain, loop_parts, microbatch, placement
from gpipe_tf.gpipe.leaves import float_leaves, with_float_leaves
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.remat import StageForward
from gpipe_tf.gpipe.schedule_base import PipelineJob, PipelineLoss, Schedule
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.weight_gradients import WeightStash


class WindowedSchedule(Schedule):
    """A schedule run by this loop: a subclass states only its order (`own_order`, with in-flight windows).

    Training runs forward, loss and backward in this loop; outside training (evaluation, or a caller without a
    loss) there is no backward order to keep, and fill-drain's forward loop runs (with the loss per micro-batch).
    """

    needs_output_spec = True  # fill-drain's forward loop preallocates the outputs

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: batch_weight_gradients (`batched_weights.define_knob`)."""
        return batched_weights.define_knob(super().params())

    def __init__(self, params: InstantiableParams, path: str = "") -> None:
        super().__init__(params, path)
        batched_weights.check_knob(self.p, path)

    def own_order(self, num_devices: int) -> ScheduleOrder:
        """The schedule's order on `num_devices` devices, before its knobs (`step_order` applies them)."""
        raise NotImplementedError

    def step_order(self, num_devices: int) -> ScheduleOrder:
        """`own_order`, with its weight gradients batched if `batch_weight_gradients`."""
        return batched_weights.apply_knob(self.own_order(num_devices), self.p)

    def run(self, job: PipelineJob, inputs: Any) -> tuple[Any, dict[str, Any] | None]:
        """The forward pass alone, as fill-drain's loop."""
        return fill_drain.run_loop(job, inputs)

    def run_with_loss(self, job: PipelineJob, inputs: Any, loss: PipelineLoss) -> tuple[dict, dict[str, Any] | None]:
        """Forward, loss and backward of every micro-batch in this loop when training, in the schedule's order."""
        if not job.training:
            return fill_drain.run_loop(job, inputs, loss=loss)
        return run_training(job, inputs, loss, self.step_order(job.plan.num_devices),
                            auto_batched=self.p.batch_weight_gradients == batched_weights.AUTO)


def run_training(job: PipelineJob, inputs: Any, loss: PipelineLoss, order: ScheduleOrder,
                 auto_batched: bool = False) -> tuple[dict, dict[str, Any] | None]:
    """Forward, loss and backward of every micro-batch of `job` in one loop ordered by `order` (its chunks are the
    job's): ({name: sum over the batch}, summed aux statistics or None); see the module doc. With `auto_batched`
    (`batch_weight_gradients="auto"`), the weights `batched_weights.auto_selection` picks get their gradients
    batched after their chunk's last backward, in `order` as it is."""
    return WindowedLoop(job, inputs, loss, order, auto_batched).run()


class LoopState(NamedTuple):
    """The windowed loop's variables. Per-chunk fields are tuples over the job's chunks, each on its chunk's
    device; a ring is a tuple of tokens whose first a cell waits for (`loop_parts.advance`)."""

    first: tf.Tensor  # the first chunk's micro-batch counter
    last: tf.Tensor  # the last chunk's micro-batch counter
    weights: tuple  # per chunk, its weights, passed through unchanged
    head_weights: tuple  # the loss head's weights, passed through unchanged
    tokens: tuple  # per chunk, a ring of in_flight[c] tokens, each made by a backward (B, or B and W)
    forward_rings: tuple  # per chunk that waits for another's forward (`forward_waits`), a ring of lag tokens
    backward_rings: tuple  # per `backward_waits` entry, a ring of lag tokens filled by that chunk's backward
    weight_rings: tuple  # per chunk, a ring of weight_window[c] tokens made by its W (split orders), else ()
    grad_sums: tuple  # per chunk, the sums of its weights' gradients
    head_sums: tuple  # the sums of the loss head's weight gradients
    values: tuple  # the sums of the loss function's values, in `WindowedLoop.names` order
    kept: tuple  # per chunk, its stashed matmul inputs and output gradients for batched W (`StashLayout`)
    aux_sums: tuple  # the sums of the auxiliary statistics (`PipelineJob.aux_spec`), flat
    input_gradients: tuple  # the pipeline input's gradient per micro-batch: TensorArrays on the first chunk


class Forward(NamedTuple):
    """One micro-batch's forward pass through every chunk: what its loss and backward need."""

    records: list[StageForward]  # per chunk, its forward (and what its gradient needs)
    stashes: list[WeightStash | None]  # per chunk, its batched-W stash
    outputs: Any  # the last chunk's output
    context: FPropContext  # the micro-batch's context (seed, aux statistics)
    micro_batch: tf.Tensor  # the micro-batch's index, on the first chunk


class WindowedLoop:
    """The loop of the module doc for one job, order and loss: `run` builds it."""

    def __init__(self, job: PipelineJob, inputs: Any, loss: PipelineLoss, order: ScheduleOrder,
                 auto_batched: bool = False) -> None:
        if order.num_chunks != job.num_chunks or order.in_flight is None:
            raise ValueError(f"the {order.name} order has {order.num_chunks} chunks and in_flight={order.in_flight}: "
                             f"this loop needs one in-flight window per chunk of the job ({job.num_chunks})")
        if len({c for c, _, _ in order.forward_waits}) != len(order.forward_waits):
            raise ValueError(f"the {order.name} order's forward_waits {order.forward_waits} give a chunk two waits: "
                             "this loop keeps one forward ring per chunk")
        self.job, self.loss, self.order = job, loss, order
        self.arguments = loop_parts.OpArguments.of(job, inputs, loss.head_weights)
        self.batched = order.batched_weights  # matmul weight gradients wait in the stash for the last backward
        self.auto_batched = auto_batched and not order.batched_weights
        self.only: list[frozenset[int]] | None = None  # with "auto", per chunk the weights it batches
        self.stash_layout = batched_weights.StashLayout(
            job.devices, job.chunk_weights if self.batched else [[] for _ in range(job.num_chunks)])
        self.waits = {c: (t, lag) for c, t, lag in order.forward_waits}  # one forward ring per waiting chunk
        self.waiting = sorted(self.waits)  # the chunks with a forward ring, in `LoopState.forward_rings` order
        self.fills: dict[int, list[int]] = {}  # {chunk t: [index into `waiting`]}: the rings t's forward fills
        for j, c in enumerate(self.waiting):
            self.fills.setdefault(self.waits[c][0], []).append(j)
        self.value_spec = loop_parts.loss_value_spec(loss, job)
        self.names = sorted(self.value_spec)
        # Made inside the custom gradient: the loop's inputs (`prepare`) and the summed aux statistics (`finish`).
        self.micro: Any = None
        self.targets: Any = None
        self.seed: tf.Tensor | None = None
        self.aux_sums: dict[str, Any] | None = None

    def run(self) -> tuple[dict, dict[str, Any] | None]:
        """The loop as one `tf.custom_gradient` op: ({name: sum over the batch}, summed aux statistics or None)."""
        @tf.custom_gradient
        def pipeline(*args: tf.Tensor) -> Any:
            split = self.arguments.stopped(args, self.job.devices[0])
            self.prepare(split.inputs)
            if self.auto_batched:
                self.choose_batched(split.chunk_weights)
            final = loop_parts.host_loop(self.body, self.initial_state(split), self.job.num_micro_batches,
                                         self.job.num_micro_batches)
            grad_sums = self.finish(final)
            return list(final.values), lambda *upstream: self.gradients(final, grad_sums, split, upstream)

        flat_values = pipeline(*self.arguments.flat)
        return dict(zip(self.names, flat_values)), self.aux_sums

    def prepare(self, xs: list[tf.Tensor]) -> None:
        """The loop's inputs: the micro-batches on the first chunk, the targets and the gradient seed on the last."""
        job, loss = self.job, self.loss
        with tf.device(job.devices[0]):
            self.micro = microbatch.split(with_float_leaves(self.arguments.inputs, xs), job.num_micro_batches)
        with tf.device(job.devices[-1]):
            self.targets = microbatch.split(loss.targets, job.num_micro_batches)
            self.seed = tf.constant(1.0) if loss.gradient_seed is None else tf.identity(loss.gradient_seed)

    def choose_batched(self, thetas: Sequence[Sequence[tf.Tensor]]) -> None:
        """With "auto": the weights to batch (`fill_drain.auto_batched_calls`, fill-drain's choice too)."""
        job = self.job
        chosen = fill_drain.auto_batched_calls(job, thetas, self.micro, self.order.name)
        if chosen is not None:
            self.batched, self.only = True, chosen[1]
            self.stash_layout = batched_weights.StashLayout(job.devices, job.chunk_weights)

    def initial_state(self, split: loop_parts.SplitArguments) -> LoopState:
        """The loop variables before the first micro-batch, each made on the device that uses it."""
        job, order = self.job, self.order
        devices = job.devices
        tokens, weight_rings, sums = [], [], []
        for c in range(job.num_chunks):
            with tf.device(devices[c]):
                tokens.append(loop_parts.ring(order.in_flight[c]))
                weight_rings.append(loop_parts.ring(order.weight_window[c]) if order.weight_window else ())
                sums.append(tuple(loop_parts.step_zeros(w.shape, w.dtype) for w in split.chunk_weights[c]))
        forward_rings = []
        for c in self.waiting:
            with tf.device(devices[self.waits[c][0]]):  # filled by chunk t's forward, read by c on the same device
                forward_rings.append(loop_parts.ring(self.waits[c][1]))
        backward_rings = []
        for _, t, lag in order.backward_waits:
            with tf.device(devices[t]):  # filled by chunk t's backward
                backward_rings.append(loop_parts.ring(lag))
        with tf.device(devices[-1]):
            # Half-precision head weights (cast by the task) still sum their gradients in float32.
            head_sums = tuple(loop_parts.step_zeros(w.shape, loop_parts.sum_dtype(w.dtype)) for w in split.head_weights)
            values = tuple(tf.zeros(self.value_spec[n].shape, self.value_spec[n].dtype) for n in self.names)
            aux_sums = tuple(tf.zeros(sp.shape, sp.dtype) for sp in tf.nest.flatten(job.aux_spec))
        with tf.device(devices[0]):
            arrays = tuple(tf.TensorArray(x.dtype, size=job.num_micro_batches,
                                          element_shape=[x.shape[0] // job.num_micro_batches] + x.shape[1:])
                           for x in split.inputs) if job.input_gradient else ()
        first, last = loop_parts.counters([devices[0], devices[-1]])
        return LoopState(first=first, last=last, weights=tuple(tuple(ws) for ws in split.chunk_weights),
                         head_weights=tuple(split.head_weights), tokens=tuple(tokens),
                         forward_rings=tuple(forward_rings), backward_rings=tuple(backward_rings),
                         weight_rings=tuple(weight_rings), grad_sums=tuple(sums),
                         head_sums=head_sums, values=values, kept=self.stash_layout.empty(), aux_sums=aux_sums,
                         input_gradients=arrays)

    def body(self, state: LoopState) -> LoopState:
        """One micro-batch's journey: its forward through every chunk, its loss, its backward."""
        state, forward = self.forward(state)
        state, dy = self.loss_step(state, forward)
        state, dx = self.backward(state, forward, dy)
        if not self.job.input_gradient:
            return state
        with placement.on_stage(self.job.chunk_scopes[0]):
            arrays = tuple(a.write(forward.micro_batch, d) for a, d in zip(state.input_gradients, dx))
        return state._replace(input_gradients=arrays)

    def forward(self, state: LoopState) -> tuple[LoopState, Forward]:
        """The next micro-batch through every chunk, each waiting for its rings (the order's windows)."""
        job = self.job
        stashes = [WeightStash(only=self.only[c] if self.only else None) if self.batched else None
                   for c in range(job.num_chunks)]
        first, index, h, ctx = loop_parts.next_micro_batch(job, state.first, self.micro, bool(job.aux_spec))
        forward_rings = list(state.forward_rings)
        records = []
        for c in range(job.num_chunks):
            with placement.on_stage(job.chunk_scopes[c]), tf.name_scope("forward"):
                # Wait for the backward of micro-batch index - in_flight[c] on this chunk (1F1B's order and its
                # bound on stashes); the chunk's own copy of its input stays on its device.
                before = [state.tokens[c][0]]
                before += [state.forward_rings[self.waiting.index(c)][0]] if c in self.waits else []
                before += [state.weight_rings[c][0]] if self.order.weight_window else []
                before += [ring[0] for ring, (w, _, _) in zip(state.backward_rings, self.order.backward_waits)
                           if w == c]
                with tf.control_dependencies(before):
                    h = tf.nest.map_structure(tf.identity, h)
                records.append(StageForward(loop_parts.chunk_fn(job, c, ctx), state.weights[c], h,
                                            c > 0 or job.input_gradient, job.plan.remat[c], stashes[c]))
                h = records[-1].outputs
                for j in self.fills.get(c, []):
                    forward_rings[j] = loop_parts.advance(state.forward_rings[j], float_leaves(h))
        state = state._replace(first=first, forward_rings=tuple(forward_rings))
        return state, Forward(records, stashes, h, ctx, index)

    def loss_step(self, state: LoopState, forward: Forward) -> tuple[LoopState, list[tf.Tensor]]:
        """The micro-batch's loss and its gradient on the last chunk: (the state with the loss's sums added, the
        gradient of the last chunk's output float leaves, seeded with the loss's gradient seed)."""
        job = self.job
        stats = loop_parts.aux_statistics(job, forward.context)
        with placement.on_stage(job.chunk_scopes[-1]):
            last_next = state.last + 1
            cell = loop_parts.micro_batch_loss(self.loss, state.head_weights, forward.outputs, self.targets,
                                               last_next - 1, self.seed, forward.context)
            got, dy = cell.values, cell.output_gradients
            head_sums = tuple(a + tf.cast(g, a.dtype) for a, g in zip(state.head_sums, cell.head_gradients))
            values = loop_parts.add_values(state.values, got, self.names)
            aux_sums = tuple(total + st for total, st in zip(state.aux_sums, stats))
        state = state._replace(last=last_next, head_sums=head_sums, values=values, aux_sums=aux_sums)
        return state, dy

    def backward(self, state: LoopState, forward: Forward,
                 dy: list[tf.Tensor]) -> tuple[LoopState, list[tf.Tensor]]:
        """The micro-batch's backward through every chunk, last to first, each turning its rings: (the state, the
        gradient of the pipeline's input on this micro-batch)."""
        n = self.job.num_chunks
        sums, tokens, weight_rings, kept = [None] * n, [None] * n, [()] * n, list(state.kept)
        backward_rings = list(state.backward_rings)
        for c in reversed(range(n)):
            with placement.on_stage(self.job.chunk_scopes[c]), tf.name_scope("backward"):
                # Unsplit orders (W with its B): the chunk's backward of this micro-batch starts once the
                # previous micro-batch's weight gradients are in the sums, so no weight gradient is computed early
                # beside them (a split order's B must not wait for W: zero bubble runs W in the gaps).
                after = () if self.order.weight_window else state.grad_sums[c]
                dx, dw = forward.records[c].gradient(dy, after)
                # None: a weight whose whole gradient waits in the stash (batched W).
                sums[c] = tuple(a if g is None else a + g for a, g in zip(state.grad_sums[c], dw))
                if self.batched:
                    kept[c] = self.stash_layout.keep(c, state.kept[c], forward.stashes[c].records)
                # Split orders (B, then W): the next forwards wait for the input gradient (B) only, and for the
                # weight gradients (W) of weight_window[c] micro-batches back through their own ring. A first
                # chunk without an input gradient has no B: its token waits for W, as in 1F1B.
                b_then_w = bool(self.order.weight_window) and bool(dx)
                token_after = list(dx) if b_then_w else list(sums[c]) + list(dx)
                tokens[c] = loop_parts.advance(state.tokens[c], token_after)
                for j, (_, t, _) in enumerate(self.order.backward_waits):
                    if t == c:
                        backward_rings[j] = loop_parts.advance(state.backward_rings[j], token_after)
                if self.order.weight_window:
                    weight_rings[c] = loop_parts.advance(state.weight_rings[c], sums[c])
                dy = dx
        state = state._replace(grad_sums=tuple(sums), tokens=tuple(tokens), weight_rings=tuple(weight_rings),
                               kept=tuple(kept), backward_rings=tuple(backward_rings))
        return state, dy

    def finish(self, final: LoopState) -> Sequence[tuple[tf.Tensor, ...]]:
        """After the loop: each chunk's weight gradient sums, with its batched W added (after its last backward, on
        its device) where the order batches them; keeps the summed aux statistics for `run`."""
        job = self.job
        if job.aux_spec:
            self.aux_sums = tf.nest.pack_sequence_as(job.aux_spec, list(final.aux_sums))
        if not self.batched:
            return final.grad_sums
        return self.stash_layout.add_weight_gradients(final.kept, final.grad_sums, job.num_micro_batches)

    def gradients(self, final: LoopState, grad_sums: Sequence[tuple[tf.Tensor, ...]],
                  split: loop_parts.SplitArguments, upstream: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The op's gradients (in `OpArguments.flat` order): what the loop summed, seeded with the loss's gradient
        seed, rescaled to the caller's upstream gradient of the 'loss' sum, each on its chunk's device."""
        job = self.job
        d_loss = upstream[self.names.index("loss")]
        grads = []
        with tf.device(job.devices[0]):
            if job.input_gradient:
                grads += [microbatch.merge(a.stack()) * loop_parts.rescale(d_loss, self.seed, x.dtype)
                          for a, x in zip(final.input_gradients, split.inputs)]
            else:
                grads += [tf.zeros_like(x) for x in split.inputs]
        for c in range(job.num_chunks):
            with tf.device(job.devices[c]):
                grads += [g * loop_parts.rescale(d_loss, self.seed, g.dtype) for g in grad_sums[c]]
        with tf.device(job.devices[-1]):
            grads += loop_parts.head_gradients(final.head_sums, split.head_weights, d_loss, self.seed)
        return grads
