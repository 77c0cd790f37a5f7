"""The stage plan of a GPipe layer: each stage's layers, what they cost, whether it recomputes, where it runs.

`make_plan(p)` computes it from the GPipe Params, and it is the only place that does: the GPipe layer runs the
plan (`GPipe.plan`), `--mode=inspect` prints it, and the trainer's partition report draws it, so none of them can
show a split or a remat decision that training does not use. It also validates everything it reads (balance,
balance_by, remat, micro_batch_shape, devices) and names the bad value, the allowed values and the fix.

Costs, per layer:

* explicit ``balance``: none are computed (``cost_kind`` is None), so any layer works, including one that cannot
  count its parameters or estimate its flops from Params.
* ``balance_by='params'`` or ``'flops'``: from Params alone; nothing is built.
* ``balance_by='time'``: each layer is built once, as a throw-away copy, and timed on a zero micro-batch; this is
  done by the ``measure`` argument (by default `time_layer_params`). `--mode=inspect` promises to build nothing,
  so it passes ``measure=None`` and gets `TimingRequiredError`, which it reports instead of showing a split
  that training would not use. Timings vary from run to run, so two 'time' plans of one model may differ.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import partition, placement, remat
from gpipe_tf.gpipe.batch_shapes import micro_batch_shapes
from gpipe_tf.hyperparams import InstantiableParams, ParamsError

LayerTimer = Callable[[Sequence[InstantiableParams], Any], Sequence[float]]


class TimingRequiredError(ParamsError):
    """The plan needs layer timings (balance_by='time' without an explicit balance) and timing was not allowed."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How a GPipe layer splits its layers into chunks: one per stage (K), or v per device for the schedules that
    run v chunks per device (`gpipe_tf/gpipe/orders.py` defines the words). The per-chunk fields are named after
    stages, which they are with v = 1.

    Attributes:
      balance: number of layers of each chunk.
      stage_layers: each chunk's layer names, ``layer_{j}`` with j the global index (names never depend on K, so
        checkpoints and dropout masks do not either).
      layer_costs: the balancing cost of every layer, or None where an explicit balance made costs unnecessary.
      cost_kind: what `layer_costs` measure, one of `partition.BALANCE_BY`, or None with no costs.
      remat: whether each chunk recomputes its forward pass in the backward pass (`remat.stage_uses_remat`).
      devices: ``devices[r][c]``, the device of replica r's chunk c; None where the plan was made without
        resolving devices (`--mode=inspect`).
      virtual_stages: chunks per device (v of the Interleaved schedule, else 1): the plan has num_chunks = v x K
        chunks (K = num_stages of the Params).
      chunk_devices: the device (0 .. K-1) of each chunk, in pipeline order: chunk c on device c mod K unless the
        schedule's order places its chunks otherwise (a V: device d holds chunks d and 2K-1-d).
    """

    balance: tuple[int, ...]
    stage_layers: tuple[tuple[str, ...], ...]
    layer_costs: tuple[float, ...] | None
    cost_kind: str | None
    remat: tuple[bool, ...]
    devices: tuple[tuple[str, ...], ...] | None
    virtual_stages: int = 1
    chunk_devices: tuple[int, ...] = (0,)

    @property
    def num_chunks(self) -> int:
        """The number of chunks, v x K: v on each of K devices (chunk c runs on device chunk_devices[c]); equal to K
        for the schedules with one chunk per device."""
        return len(self.balance)

    @property
    def num_devices(self) -> int:
        """K, the devices (stages) one replica runs on."""
        return len(self.balance) // self.virtual_stages

    def layer_indices(self, chunk: int) -> range:
        """Global indices of the layers of `chunk`."""
        start = sum(self.balance[:chunk])
        return range(start, start + self.balance[chunk])

    def stage_costs(self) -> tuple[float, ...] | None:
        """The summed layer cost of each chunk, or None without costs."""
        if self.layer_costs is None:
            return None
        return tuple(sum(self.layer_costs[j] for j in self.layer_indices(c)) for c in range(self.num_chunks))


def micro_batch_spec(p: InstantiableParams, path: str = "") -> tf.TensorSpec | tuple[tf.TensorSpec, ...]:
    """The TensorSpec of one micro-batch of the first layer's input, from p.micro_batch_shape and p.input_dtype;
    a tuple of them for a pipeline fed several tensors (micro_batch_shape a list of shapes, input_dtype one dtype
    for all or a list of one per shape)."""
    if p.micro_batch_shape is None:
        raise ParamsError(f"{path or p.name}: balance_by={p.balance_by!r} needs micro_batch_shape (the shape of one "
                          "micro-batch of the first layer's input, batch dimension first, e.g. [8, 224, 224, 3]); "
                          "set it, or give an explicit balance, or use balance_by='params'")
    shapes, several = micro_batch_shapes(p.micro_batch_shape)
    dtype = p.input_dtype
    if not several:
        return tf.TensorSpec(shapes[0], dtype)
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)
    if len(dtypes) != len(shapes):
        raise ParamsError(f"{path or p.name}: input_dtype={dtype!r} names {len(dtypes)} dtypes for the "
                          f"{len(shapes)} input shapes of micro_batch_shape={p.micro_batch_shape!r}; give one dtype "
                          "for all or one per shape")
    return tuple(tf.TensorSpec(s, d) for s, d in zip(shapes, dtypes))


def time_layer_params(layers: Sequence[InstantiableParams], input_spec: Any) -> list[float]:
    """Forward seconds of each layer on a zero micro-batch of `input_spec`, from throw-away copies of the layers."""
    sample = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), input_spec)
    return partition.time_layers([lp.copy().instantiate() for lp in layers], sample)


def make_plan(p: InstantiableParams, *, chunk_devices: Sequence[int] | None = None, input_spec: Any = None,
              num_replicas: int | None = 1, measure: LayerTimer | None = time_layer_params,
              path: str = "") -> StagePlan:
    """The stage plan of the GPipe layer configured by `p` (GPipe.params()).

    Args:
      p: the GPipe Params (layers, num_stages, balance, balance_by, micro_batch_shape, input_dtype, remat,
        device_kind, devices).
      chunk_devices: the device of each chunk, from the schedule's order (`Schedule.step_order(K).devices_by_chunk`):
        v x K entries with each device 0 .. K-1 named v times; None: one chunk per device, chunk c on device c.
      input_spec: one micro-batch of the first layer's input (any nested TensorSpecs), for balance_by 'flops' or
        'time'; None: `micro_batch_spec(p)`.
      num_replicas: data-parallel replicas to place (D); None: leave devices unresolved (plan.devices is None).
      measure: times the layers for balance_by='time'; None: refuse to, raising TimingRequiredError.
      path: the layer's path, for error messages; empty: p.name.

    Raises:
      ParamsError: a bad value in `p`; the message names it, the allowed values and the fix.
      TimingRequiredError: balance_by='time' with no explicit balance and `measure` is None.
    """
    path = path or p.name or "GPipe"
    layers = list(p.layers)
    num_layers, num_devices = len(layers), p.num_stages
    chunk_devices = _check_chunk_devices(chunk_devices, num_devices, path)
    k = len(chunk_devices)
    v = k // max(1, num_devices)
    if not layers:
        raise ParamsError(f"{path}.layers is empty; give the layer Params to pipeline")
    if num_devices < 1 or k > num_layers:
        raise ParamsError(_too_many_chunks(p, num_layers, v, path))
    if p.balance_by not in partition.BALANCE_BY:
        raise ParamsError(f"{path}.balance_by={p.balance_by!r} is not one of {partition.BALANCE_BY}; use one of "
                          "them, or give an explicit balance")
    if p.remat not in remat.POLICIES:
        raise ParamsError(f"{path}.remat={p.remat!r} is not one of {remat.POLICIES}; use one of them ('always' "
                          "keeps only each stage's input per micro-batch)")
    devices = None if num_replicas is None else tuple(
        tuple(replica[d] for d in chunk_devices) for replica in _replica_devices(p, num_replicas, path))
    if p.balance is not None:
        balance, costs, kind = _check_balance(p, k, num_layers, path), None, None
    else:
        costs, kind = _layer_costs(p, layers, input_spec, measure, path), p.balance_by
        balance = tuple(partition.balance_costs(costs, k))
    names, start = [], 0
    for size in balance:
        names.append(tuple(f"layer_{j}" for j in range(start, start + size)))
        start += size
    return StagePlan(balance=balance, stage_layers=tuple(names), layer_costs=costs, cost_kind=kind,
                     remat=tuple(remat.stage_uses_remat(p.remat, s, k) for s in range(k)), devices=devices,
                     virtual_stages=v, chunk_devices=chunk_devices)


def _too_many_chunks(p: InstantiableParams, num_layers: int, v: int, path: str) -> str:
    """The error of a plan whose num_stages is below 1 or whose v x K chunks outnumber the layers (each chunk needs
    one), with the changes that fit: fewer stages, fewer virtual stages, or, for a model with fewer layers than v,
    a schedule with one chunk per device."""
    k = p.num_stages
    virtual_knob = isinstance(p.schedule, InstantiableParams) and "virtual_stages" in p.schedule
    per_device = "" if v == 1 else (f" x schedule.virtual_stages={v}" if virtual_knob else f" x {v} chunks per device")
    chunks = f" = {k * v} chunks" if v > 1 and k >= 1 else ""
    fixes = []
    if num_layers // v >= 1:
        fixes.append(f"num_stages <= {num_layers // v}" if k >= 1 else f"num_stages between 1 and {num_layers // v}")
    if v > 1 and virtual_knob and k >= 1 and num_layers // k >= 2:
        fixes.append(f"schedule.virtual_stages <= {num_layers // k}")
    if fixes:
        fix = "use " + " or ".join(fixes)
    else:
        fix = (f"{num_layers} layers are too few for {v} chunks per device: use a schedule with one chunk per device "
               f"('fill_drain' or 'one_f_one_b') and num_stages <= {num_layers}")
    return (f"{path}.num_stages={k!r}{per_device}{chunks} must be between 1 and the number of layers ({num_layers}); "
            f"{fix}")


def _check_chunk_devices(chunk_devices: Sequence[int] | None, num_devices: Any, path: str) -> tuple[int, ...]:
    """`chunk_devices` as a tuple (None: chunk c on device c), or a ParamsError unless it names each of the
    num_devices devices equally often."""
    if chunk_devices is None:
        return tuple(range(num_devices)) if isinstance(num_devices, numbers.Integral) and num_devices > 0 else (0,)
    given = tuple(chunk_devices)
    k = num_devices if isinstance(num_devices, numbers.Integral) and num_devices > 0 else 1
    v = len(given) // k
    if v < 1 or sorted(given) != sorted(list(range(k)) * v):
        raise ParamsError(f"{path}: chunk_devices={list(given)!r} must name each of the num_stages={num_devices} "
                          "devices (0 .. num_stages-1) equally often, once per chunk; pass the schedule order's "
                          "devices_by_chunk for this num_stages")
    return given


def _check_balance(p: InstantiableParams, k: int, num_layers: int, path: str) -> tuple[int, ...]:
    """The explicit balance of `k` pipeline stages as a tuple, or a ParamsError saying which rule it breaks and
    what would work."""
    given = p.balance
    example = partition.balance_costs([1.0] * num_layers, k)
    entries = list(given) if isinstance(given, (list, tuple)) else None
    if entries is None or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in entries):
        problem = "it must be a list of whole numbers"
    elif len(entries) != k:
        problem = f"it has {len(entries)} entries"
    elif any(b < 1 for b in entries):
        stage = next(s for s, b in enumerate(entries) if b < 1)
        problem = f"stage {stage} has {entries[stage]} layers (every stage needs at least one)"
    elif sum(entries) != num_layers:
        problem = f"its entries sum to {sum(entries)}"
    else:
        return tuple(int(b) for b in entries)
    shown = entries if entries is not None else given
    stages = f"num_stages={k}" if k == p.num_stages else f"num_stages x virtual_stages={k}"
    raise ParamsError(f"{path}.balance={shown!r} must have {stages} positive entries summing to the number of "
                      f"layers ({num_layers}), but {problem}; use e.g. balance={example}, or balance=None to balance "
                      f"by balance_by={p.balance_by!r}")


def _layer_costs(p: InstantiableParams, layers: list[InstantiableParams], input_spec: Any,
                 measure: LayerTimer | None, path: str) -> tuple[float, ...]:
    if p.balance_by == "params":
        return tuple(float(c) for c in partition.layer_param_counts(layers))
    spec = micro_batch_spec(p, path) if input_spec is None else input_spec
    if p.balance_by == "flops":
        return tuple(partition.layer_flops(layers, spec))
    if measure is None:
        raise TimingRequiredError(f"{path}: balance_by='time' balances by timing each layer, which builds it; this "
                                  "caller builds nothing (e.g. --mode=inspect), so it cannot know the split training "
                                  "will use. Give an explicit balance, or use balance_by='params' or 'flops', to see "
                                  "it here")
    costs = tuple(float(c) for c in measure(layers, spec))
    if len(costs) != len(layers):
        raise ParamsError(f"{path}: the layer timer returned {len(costs)} times for {len(layers)} layers")
    return costs


def _replica_devices(p: InstantiableParams, num_replicas: int, path: str) -> tuple[tuple[str, ...], ...]:
    """devices[r][k] of D replicas: p.devices if given (one list, or D lists of K), else by p.device_kind."""
    k = p.num_stages
    if num_replicas < 1:
        raise ParamsError(f"train.num_replicas={num_replicas} must be >= 1")
    if p.devices is None:
        nested = placement.replica_stage_devices(num_replicas, k, p.device_kind)
    else:
        nested = [list(d) for d in p.devices] if p.devices and not isinstance(p.devices[0], str) else [
            list(p.devices)]
        if len(nested) != num_replicas or any(len(d) != k for d in nested):
            raise ParamsError(f"{path}.devices={p.devices!r} must hold one device per stage ({k}), or {k} "
                              f"devices for each of the {num_replicas} replicas")
    return tuple(tuple(d) for d in nested)
