"""Balancing a layer sequence into K contiguous stages by a cost, and the partition table.

`plan.make_plan` decides which cost (or an explicit balance) applies; this module computes the costs and the split.

Costs come from Params alone (parameter count, estimated flops), so a multi-billion-parameter configuration can be
partitioned and inspected without allocating it; or from timing each layer once on a sample micro-batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.estimates import estimate

BALANCE_BY = ("params", "flops", "time")


@dataclasses.dataclass
class StageInfo:
    """One row of the partition table; cost is None where an explicit balance needed no costs."""

    stage: int
    layers: list[str]
    params: int
    remat: bool
    device: str
    cost: float | None


def layer_param_counts(layer_params: Sequence[InstantiableParams]) -> list[int]:
    """Trainable parameters of each layer, from Params alone."""
    counts = []
    for i, lp in enumerate(layer_params):
        try:
            counts.append(int(estimate(lp, "num_params")))
        except NotImplementedError:
            raise ParamsError(f"layer {i} ({lp.cls.__name__}) cannot count its parameters from Params; give an "
                              "explicit balance or use balance_by='time'") from None
    return counts


def layer_flops(layer_params: Sequence[InstantiableParams], input_spec: Any) -> list[float]:
    """Estimated forward flops of each layer for one micro-batch of `input_spec`, from Params alone."""
    flops, spec = [], input_spec
    for i, lp in enumerate(layer_params):
        try:
            flops.append(float(estimate(lp, "flops", spec)))
            spec = estimate(lp, "output_spec", spec)
        except NotImplementedError:
            raise ParamsError(f"layer {i} ({lp.cls.__name__}) cannot estimate its flops from Params; use "
                              "balance_by='params' or 'time', or an explicit balance") from None
    return flops


def balance_costs(costs: Sequence[float], num_stages: int) -> list[int]:
    """Splits `costs` into `num_stages` contiguous non-empty parts minimizing the largest part's sum.

    Returns the number of layers per stage. Exact dynamic programming over (stages, layers), where
    best[k][j] = min over s of max(best[k-1][s], cost of layers s..j-1). Costs are >= 0, so best[k-1][s] grows with
    s and the last stage's cost shrinks with s: the minimum sits where the two cross, and that crossing only moves
    right as j grows. Walking it with one pointer per k makes the whole split O(K n) (K=128 stages of 1,665
    layers: well under a second; the plain O(K n^2) search took over a minute there). Of several optimal cuts the
    later one is taken, which moves layers towards later stages (they also hold the loss).
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ParamsError(f"num_stages={num_stages} must be between 1 and the number of layers ({n})")
    bad = next((i for i, c in enumerate(costs) if not float(c) >= 0.0), None)
    if bad is not None:
        raise ParamsError(f"layer {bad} has cost {costs[bad]!r}; balancing needs costs >= 0 (parameter counts, "
                          "flops or seconds)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: smallest max-stage cost placing the first j layers into k stages; cut[k][j]: start of stage k.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        previous, first = best[k - 1], k - 1
        last_j = n - (num_stages - k)
        # plateau_end[s]: the last s' <= last_j - 1 with previous[s'] == previous[s] (ties go to the later cut).
        plateau_end = list(range(last_j + 1))
        for s in range(last_j - 2, first - 1, -1):
            if previous[s + 1] == previous[s]:
                plateau_end[s] = plateau_end[s + 1]
        cross = first  # the first s with previous[s] >= prefix[j] - prefix[s]; non-decreasing in j
        for j in range(k, last_j + 1):
            while cross < j and previous[cross] < prefix[j] - prefix[cross]:
                cross += 1
            # Cuts s >= cross cost previous[s] (non-decreasing): the best is `cross` or the end of its plateau.
            # Cuts s < cross cost prefix[j] - prefix[s] (non-increasing): the best is cross - 1.
            choice, value = None, inf
            if cross > first:
                choice, value = cross - 1, prefix[j] - prefix[cross - 1]
            if cross < j and previous[cross] <= value:
                choice, value = min(plateau_end[cross], j - 1), previous[cross]
            best[k][j], cut[k][j] = value, choice
    sizes, j = [], n
    for k in range(num_stages, 0, -1):
        s = cut[k][j]
        sizes.append(j - s)
        j = s
    return sizes[::-1]


def time_layers(layers: Sequence[Any], sample: Any, repeats: int = 3) -> list[float]:
    """Median forward time of each built layer on `sample` (a micro-batch), run in order as a chain."""
    times, x = [], sample
    ctx = FPropContext(training=False)
    for layer in layers:
        fn = tf.function(lambda inp, layer=layer: layer.fprop(layer.theta, inp, ctx), autograph=False)
        y = fn(x)  # trace and warm up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), fn(x))
            samples.append(time.perf_counter() - start)
        times.append(sorted(samples)[len(samples) // 2])
        x = y
    return times


def format_table(rows: Sequence[StageInfo], cost_name: str) -> str:
    """The partition table as aligned text: stage, layers, params, remat, device, cost ('-' without costs)."""
    lines = [f"{'stage':>5}  {'layers':<28} {'params':>14}  {'remat':<5}  {'device':<36} {cost_name:>12}"]
    for r in rows:
        span = f"{r.layers[0]} .. {r.layers[-1]} ({len(r.layers)})" if len(r.layers) > 1 else r.layers[0]
        cost = "-" if r.cost is None else f"{r.cost:.4g}"
        lines.append(f"{r.stage:>5}  {span:<28} {r.params:>14,}  {'yes' if r.remat else 'no':<5}  {r.device:<36} "
                     f"{cost:>12}")
    total = sum(r.params for r in rows)
    lines.append(f"{'total':>5}  {'':<28} {total:>14,}")
    return "\n".join(lines)
