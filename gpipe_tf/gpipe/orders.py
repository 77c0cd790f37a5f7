"""A schedule's order as plain data (`ScheduleOrder`), stated once by each schedule and read by everything that
needs it: the TF loop that runs it (the token rings of `windowed_loop.py`), `timeline.predict`, the measured
timeline reader (`bench/measured_timeline.py`), the benchmark's bound and the tests.

Words (the same in the loops, `timeline.py` and the docs): K devices, one pipeline *stage* each (`num_stages` in
the GPipe Params); the layers are cut into S = v x K *chunks*, chunk c running on device `device(c)`: c mod K by
default (round robin), or as `chunk_devices` gives (a V: device d holds chunks d and 2K-1-d). A micro-batch passes
every device v times; the *lap* of a chunk (`lap(c)`, 0 .. v-1) says which pass it is, and `chunk_at(d, lap)` is
the inverse. With v = 1 (most schedules) chunk c is stage c.

The data describes the cells of one step: F(c, i) and B(c, i), the forward and the backward of chunk c on
micro-batch i. Their dependencies:

* F(c, i) after F(c-1, i) (its input) and after F(c, i-1) (each chunk takes micro-batches in order);
* B(c, i) after B(c+1, i) (its output gradient); the last chunk's B(S-1, i) after its own F(S-1, i) when the loss
  is computed per micro-batch inside the pipeline, else after the whole forward pass (the output gradient of
  the concatenated output exists only then);
* B(c, i) after the chunk's previous backward: of i+1 where backwards go last to first, else of i-1;
* `in_flight[c]` = w: F(c, i) after B(c, i - w): chunk c holds at most w micro-batches between their forward
  and their backward (the loop's ring of w tokens per chunk);
* `forward_waits` (c, t, lag): F(c, i) after F(t, i - lag) (a further ring on one device);
* `backward_waits` (c, t, lag): F(c, i) after B(t, i - lag) (a ring filled by another chunk's backward, on one
  device): what bounds the sum of two chunks' stashes on a device where each window bounds only its own chunk.

With `weight_window` (zero-bubble orders) a chunk's backward is two cells: B(c, i), the input gradient, which the
previous chunk waits for, and W(c, i), the weight gradients, which only the optimizer needs. The in-flight window
then counts B only, so a chunk's next forward need not wait for its weight gradients, and W(c, i) runs after
B(c, i) and W(c, i-1), in a bubble or beside later cells; `weight_window[c]` = u bounds how far W may lag:
F(c, i) after W(c, i - u) (the loop's ring of u tokens), so at most u micro-batches' weight-gradient stashes wait.
Where W runs within that bound is the worker's choice: TensorFlow's runs W's ops with B's, as their inputs arrive
(`timeline.predict` draws both cases, `defer_weights`).

With `batched_weights` a chunk's W cells run after its last B, as one batched matmul per weight over every
micro-batch (`gpipe_tf/layers/weight_gradients.py`): W(c, i) after the chunk's last B and W(c, i-1). Its cells
are the batched work in M equal parts; the stashes for W (matmul inputs and output gradients) wait for all M.

Within those, a device runs whatever cell is ready, one at a time, as a TensorFlow worker runs ops as their
inputs arrive. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses

from gpipe_tf.hyperparams import ParamsError

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"

CellKey = tuple  # (phase, chunk, micro-batch)


@dataclasses.dataclass(frozen=True)
class ScheduleOrder:
    """One schedule's order of a step's cells on K devices; see the module doc for what each field means.

    Attributes:
      name: the order's name in pictures and logs (e.g. 'one_f_one_b').
      num_devices: K.
      virtual_stages: v, chunks per device; the pipeline has v x K chunks, chunk c on `device(c)`.
      in_flight: per chunk, the most micro-batches it holds between forward and backward; None: no bound
        (every forward may run before any backward).
      forward_waits: (chunk c, chunk t, lag): F(c, i) also waits for F(t, i - lag).
      backward_waits: (chunk c, chunk t, lag): F(c, i) also waits for B(t, i - lag).
      loss_per_micro_batch: the last chunk computes each micro-batch's loss and its gradient right after its
        forward (1F1B); False: the backward starts from the gradient of the whole output.
      head_in_forward: the last chunk computes each micro-batch's loss (and its output gradient) right after its
        forward, though the backward still waits for every forward (FillDrain), so one micro-batch's loss head
        is alive at a time. `head_per_micro_batch` is this or loss_per_micro_batch; both False: the loss runs
        once on all M outputs (Unrolled).
      backward_reversed: each chunk's backwards visit micro-batches M-1 .. 0 (GPipe's drain), else 0 .. M-1.
      micro_batch_multiple: M must be a multiple of this (K for Megatron-LM's groups of K micro-batches).
      weight_window: per chunk, how many micro-batches' weight gradients (W) may wait after their input
        gradients (B); None: B and W are one cell, the whole backward.
      chunk_devices: per chunk, the device it runs on, each device holding v chunks; None: chunk c on device
        c mod K (round robin). `devices_by_chunk` resolves it.
      batched_weights: W runs after the chunk's last backward, batched over all micro-batches (excludes
        weight_window).
    """

    name: str
    num_devices: int
    virtual_stages: int = 1
    in_flight: tuple[int, ...] | None = None
    forward_waits: tuple[tuple[int, int, int], ...] = ()
    backward_waits: tuple[tuple[int, int, int], ...] = ()
    loss_per_micro_batch: bool = False
    head_in_forward: bool = False
    backward_reversed: bool = True
    micro_batch_multiple: int = 1
    weight_window: tuple[int, ...] | None = None
    chunk_devices: tuple[int, ...] | None = None
    batched_weights: bool = False

    def __post_init__(self) -> None:
        for field, value in (("num_devices", self.num_devices), ("virtual_stages", self.virtual_stages),
                             ("micro_batch_multiple", self.micro_batch_multiple)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamsError(f"ScheduleOrder.{field}={value!r} is invalid: it must be an int >= 1")
        if self.in_flight is not None and (len(self.in_flight) != self.num_chunks
                                           or any(w < 1 for w in self.in_flight)):
            raise ParamsError(f"ScheduleOrder.in_flight={self.in_flight!r} is invalid: give one window >= 1 per "
                              f"chunk ({self.num_chunks}), or None for no bound")
        if self.weight_window is not None and (len(self.weight_window) != self.num_chunks
                                               or any(u < 1 for u in self.weight_window)):
            raise ParamsError(f"ScheduleOrder.weight_window={self.weight_window!r} is invalid: give one window >= 1 "
                              f"per chunk ({self.num_chunks}), or None for no separate weight gradients")
        if self.chunk_devices is not None and (
                len(self.chunk_devices) != self.num_chunks
                or sorted(self.chunk_devices) != sorted(list(range(self.num_devices)) * self.virtual_stages)):
            raise ParamsError(f"ScheduleOrder.chunk_devices={self.chunk_devices!r} is invalid: give the device of "
                              f"each of the {self.num_chunks} chunks, each device in [0, {self.num_devices}) "
                              f"holding virtual_stages={self.virtual_stages} of them, or None for round robin")
        if self.batched_weights and self.weight_window is not None:
            raise ParamsError(f"ScheduleOrder.weight_window={self.weight_window!r} with batched_weights=True: batched "
                              "weight gradients run after the last backward, so no window bounds them; give one "
                              "of the two (`with_batched_weights` drops the window)")
        for field, waits in (("forward_waits", self.forward_waits), ("backward_waits", self.backward_waits)):
            for s, t, lag in waits:
                if not (0 <= s < self.num_chunks and 0 <= t < self.num_chunks and lag >= 1):
                    raise ParamsError(f"ScheduleOrder.{field} entry {(s, t, lag)!r} is invalid: chunks in "
                                      f"[0, {self.num_chunks}) and a lag >= 1")

    @property
    def num_chunks(self) -> int:
        """S = v x K, the chunks a micro-batch passes; K is `num_devices`."""
        return self.num_devices * self.virtual_stages

    @property
    def devices_by_chunk(self) -> tuple[int, ...]:
        """The device of each chunk: `chunk_devices`, or chunk mod K."""
        if self.chunk_devices is not None:
            return self.chunk_devices
        return tuple(c % self.num_devices for c in range(self.num_chunks))

    @property
    def head_per_micro_batch(self) -> bool:
        """Whether the loss head works on one micro-batch at a time (`loss_per_micro_batch` or `head_in_forward`);
        False: on all M outputs at once."""
        return self.loss_per_micro_batch or self.head_in_forward

    def device(self, chunk: int) -> int:
        """The device of chunk `chunk`."""
        return self.devices_by_chunk[chunk]

    def lap(self, chunk: int) -> int:
        """Which pass over its device chunk `chunk` is: 0 for the device's first chunk in pipeline order, up to
        v - 1."""
        return self.devices_by_chunk[:chunk].count(self.device(chunk))

    def chunk_at(self, device: int, lap: int) -> int:
        """The chunk that device `device` runs on pass `lap` (the inverse of `device` and `lap`)."""
        return [c for c, d in enumerate(self.devices_by_chunk) if d == device][lap]

    def bubble_bound(self, num_micro_batches: int) -> float:
        """GPipe's bound, the idle fraction with equal chunk costs: (K-1)/(vM+K-1) ((K-1)/(M+K-1) for v = 1).
        Orders with separate weight gradients go below it where W waits for the bubbles
        (`timeline.predict(..., defer_weights=True)`)."""
        k = self.num_devices
        return (k - 1) / (self.virtual_stages * num_micro_batches + k - 1)

    def check_micro_batches(self, num_micro_batches: int, path: str = "") -> None:
        """Raises ParamsError when this order cannot run `num_micro_batches` (not a multiple of
        `micro_batch_multiple`), naming the value and the fix."""
        q, m = self.micro_batch_multiple, num_micro_batches
        if m % q:
            near = sorted({max(q, m // q * q), (m // q + 1) * q})
            raise ParamsError(f"{path + '.' if path else ''}num_micro_batches={m} is not a multiple of "
                              f"num_stages={q}: the {self.name} order runs micro-batches in groups of num_stages; "
                              f"use num_micro_batches={' or '.join(map(str, near))} (a multiple of {q} that divides "
                              "the batch size), or the OneForwardOneBackward schedule ('one_f_one_b')")

    @property
    def phases(self) -> tuple[str, ...]:
        """The cells of one chunk and micro-batch: ('F', 'B'), and 'W' with separate weight gradients."""
        split = self.weight_window is not None or self.batched_weights
        return (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)

    def dependencies(self, phase: str, chunk: int, micro_batch: int, num_micro_batches: int) -> list[CellKey]:
        """The cells (phase, chunk, micro_batch) that must end before this one starts; see the module doc."""
        s, i, m, last = chunk, micro_batch, num_micro_batches, self.num_chunks - 1
        deps: list[CellKey] = []
        if phase == WEIGHT:
            after = self.backward_micro_batch(m - 1, m) if self.batched_weights else i
            return [(BACKWARD, s, after)] + ([(WEIGHT, s, i - 1)] if i > 0 else [])
        if phase == FORWARD:
            if s > 0:
                deps.append((FORWARD, s - 1, i))
            if i > 0:
                deps.append((FORWARD, s, i - 1))
            if self.in_flight is not None and i - self.in_flight[s] >= 0:
                deps.append((BACKWARD, s, i - self.in_flight[s]))
            deps += [(FORWARD, t, i - lag) for w, t, lag in self.forward_waits if w == s and i - lag >= 0]
            deps += [(BACKWARD, t, i - lag) for w, t, lag in self.backward_waits if w == s and i - lag >= 0]
            if self.weight_window is not None and i - self.weight_window[s] >= 0:
                deps.append((WEIGHT, s, i - self.weight_window[s]))
            return deps
        if s < last:
            deps.append((BACKWARD, s + 1, i))
        else:
            deps.append((FORWARD, s, i if self.loss_per_micro_batch else m - 1))
        previous = i + 1 if self.backward_reversed else i - 1
        if 0 <= previous < m:
            deps.append((BACKWARD, s, previous))
        return deps

    def backward_micro_batch(self, n: int, num_micro_batches: int) -> int:
        """The micro-batch of a chunk's n-th backward in a step."""
        return num_micro_batches - 1 - n if self.backward_reversed else n


def with_batched_weights(order: ScheduleOrder) -> ScheduleOrder:
    """`order` with its weight gradients batched after each chunk's last backward, and no weight window and no
    `backward_waits`: every chunk keeps its matmuls' inputs and output gradients of all M micro-batches for the
    batched W, so a wait that bounds what two chunks hold together would cost its bubble and save little."""
    return dataclasses.replace(order, weight_window=None, batched_weights=True, backward_waits=())


def fill_drain(num_devices: int) -> ScheduleOrder:
    """GPipe: every forward, then the backwards from the last micro-batch to the first (FillDrain, Unrolled). The
    loss runs on all M outputs at once; `FillDrain.step_order` runs it per micro-batch (`head_in_forward`)."""
    return ScheduleOrder("fill_drain", num_devices)


def one_f_one_b(num_devices: int, virtual_stages: int = 1, name: str = "one_f_one_b") -> ScheduleOrder:
    """PipeDream-Flush: the loss per micro-batch in the last chunk, chunk c holding at most S - c micro-batches,
    so each chunk settles into one forward, one backward. With v > 1 (Megatron-LM's interleaving) device d's first
    chunk also starts micro-batch i only after its last chunk's forward of i - K, so groups of K micro-batches
    pass every chunk of a device in turn, and M must be a multiple of K."""
    k, v = num_devices, virtual_stages
    chunks = k * v
    waits = tuple((d, d + (v - 1) * k, k) for d in range(k)) if v > 1 else ()
    return ScheduleOrder(name, k, v, in_flight=tuple(chunks - c for c in range(chunks)), forward_waits=waits,
                         loss_per_micro_batch=True, backward_reversed=False, micro_batch_multiple=k if v > 1 else 1)


def interleaved(num_devices: int, virtual_stages: int) -> ScheduleOrder:
    """Megatron-LM's interleaved 1F1B: `one_f_one_b` over v chunks per device, in groups of K micro-batches."""
    order = one_f_one_b(num_devices, virtual_stages, name="interleaved")
    return dataclasses.replace(order, micro_batch_multiple=num_devices)


def zero_bubble(num_devices: int) -> ScheduleOrder:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B's order and in-flight windows with each
    backward split into B and W; W may lag B by K - c micro-batches on chunk c, so the weight gradients fill the
    bubbles of the drain while the stashes stay within 1F1B's count plus the waiting W's."""
    order = one_f_one_b(num_devices, name="zero_bubble")
    return dataclasses.replace(order, weight_window=order.in_flight)


def zero_bubble_v(num_devices: int) -> ScheduleOrder:
    """ZB-V (Qi et al., 2024; torch's ScheduleZBVZeroBubble): 2K chunks in a V, device d holding chunks d and
    2K-1-d, so the first and the last chunk (and the loss) share device 0 and the turn of the V stays on device
    K-1 with no transfer. The windows are ZB-H1's over the 2K chunks: chunk c holds at most 2K - c micro-batches
    between its forward and its input gradient, and as many weight gradients may wait, so W fills the bubbles.

    The windows bound each chunk alone: device d's two chunks could hold 2K - d and d + 1 micro-batches at once,
    2K + 1 half-stages. As in the paper's schedule (and torch's), each of a device's two chunks also starts
    micro-batch i only after the other's backward of micro-batch i - K (`backward_waits`), so the device holds at
    most 2K half-stages, the K whole stages 1F1B's first device holds."""
    k = num_devices
    chunks = 2 * k
    windows = tuple(chunks - c for c in range(chunks))
    return ScheduleOrder("zero_bubble_v", k, 2, in_flight=windows, loss_per_micro_batch=True, backward_reversed=False,
                         weight_window=windows, chunk_devices=tuple(min(c, chunks - 1 - c) for c in range(chunks)),
                         backward_waits=tuple((c, chunks - 1 - c, k) for c in range(chunks)))
