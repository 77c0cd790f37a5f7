"""Partitioning: the balancer's optimum, costs from Params alone, and every balance_by mode."""

import itertools

import pytest
import tensorflow as tf

from gpipe_tf.gpipe import partition
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.transformer import TransformerEncoderLayer


def brute_force(costs, k):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = (0, *cuts, len(costs))
        worst = max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("costs", [[1, 1, 1, 1], [5, 1, 1, 1, 1, 5], [1, 2, 3, 4, 5, 6, 7], [9, 1, 1, 1, 1, 1, 1, 9]])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_balance_is_optimal(costs, k):
    sizes = partition.balance_costs(costs, k)
    assert len(sizes) == k and sum(sizes) == len(costs) and min(sizes) >= 1
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    worst = max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    assert worst == brute_force(costs, k)


def test_costs_from_params_alone_without_variables():
    layers = [Linear.params().set(input_dim=8, output_dim=32), Linear.params().set(input_dim=32, output_dim=4)]
    assert partition.layer_param_counts(layers) == [8 * 32 + 32, 32 * 4 + 4]
    flops = partition.layer_flops(layers, tf.TensorSpec([10, 8]))
    assert flops == [2 * 10 * 8 * 32, 2 * 10 * 32 * 4]
    # A GPipe-paper-sized layer is counted instantly, without allocating its 50M parameters.
    big = TransformerEncoderLayer.params().set(model_dim=2048, num_heads=32, hidden_dim=8192)
    assert partition.layer_param_counts([big]) == [50_358_272]


@pytest.mark.parametrize("balance_by", ["params", "flops", "time"])
def test_every_balance_mode_builds_a_sane_split(balance_by):
    dims = [4, 64, 4, 64, 4]  # costs 320, 260, 320, 260: the only optimum is [2, 2]
    layers = [Linear.params().set(input_dim=a, output_dim=b) for a, b in zip(dims[:-1], dims[1:])]
    pipe = GPipe.params().set(layers=layers, num_stages=2, balance_by=balance_by, micro_batch_shape=[8, 4],
                              devices=["/device:CPU:0", "/device:CPU:1"]).instantiate()
    assert sum(pipe.balance) == 4 and len(pipe.balance) == 2
    if balance_by != "time":  # timing is noisy; the cost-based splits are exact
        assert pipe.balance == [2, 2]
    # The table's per-stage counts (from the built variables) add up to the Params-only count of the layers.
    assert sum(row.params for row in pipe.partition_rows) == sum(partition.layer_param_counts(layers))
    if balance_by != "time":
        assert [row.params for row in pipe.partition_rows] == [580, 580]


def test_flops_balance_needs_a_sample_shape():
    layers = [Linear.params().set(input_dim=2, output_dim=2)] * 2
    with pytest.raises(ParamsError, match="needs micro_batch_shape"):
        GPipe.params().set(layers=layers, num_stages=2, balance_by="flops").instantiate()


def quadratic_balance(costs, k):
    """The plain O(K n^2) dynamic program, ties to the later cut: the reference for the O(K n) one."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    best = [[float("inf")] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for stage in range(1, k + 1):
        for j in range(stage, n - (k - stage) + 1):
            for s in range(stage - 1, j):
                value = max(best[stage - 1][s], prefix[j] - prefix[s])
                if value <= best[stage][j]:
                    best[stage][j], cut[stage][j] = value, s
    sizes, j = [], n
    for stage in range(k, 0, -1):
        sizes.append(j - cut[stage][j])
        j = cut[stage][j]
    return sizes[::-1]


@pytest.mark.parametrize("seed", range(40))
def test_linear_balance_equals_the_quadratic_program_ties_included(seed):
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 40)
    kind = seed % 4
    if kind == 0:
        costs = [rng.randint(0, 3) for _ in range(n)]  # many ties and zeros
    elif kind == 1:
        costs = [rng.random() for _ in range(n)]
    elif kind == 2:
        costs = [1.0] * n
    else:
        costs = [rng.choice([0.0, 1e-9, 5.0, 1e6]) for _ in range(n)]
    for k in sorted({1, n, rng.randint(1, n), rng.randint(1, n)}):
        assert partition.balance_costs(costs, k) == quadratic_balance(costs, k), (costs, k)


def test_negative_cost_is_an_error():
    with pytest.raises(ParamsError, match=r"layer 1 has cost -1.*>= 0"):
        partition.balance_costs([1.0, -1.0, 2.0], 2)
