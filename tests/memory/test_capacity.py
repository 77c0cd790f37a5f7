"""The capacity search: for each K, the largest knob value whose memory plan fits (checked against the planner
itself one step on either side, and the bisection against a linear scan)."""

import random

import pytest
import tensorflow as tf

from gpipe_tf import experiment
from gpipe_tf.capacity import capacity, format_capacity, largest, plan_with, stage_counts
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe import microbatch
from gpipe_tf.gpipe.pipeline import find_pipelines

MODEL = "mt.gpipe_paper.TransformerLTinyOffline"
SHAPED = "task.network.micro_batch_shape=[4, 16],task.network.input_dtype='int32'"
BUDGET = 8 * 2 ** 20


@pytest.mark.parametrize("seed", range(20))
def test_largest_equals_a_linear_scan(seed):
    rng = random.Random(seed)
    step = rng.choice([1, 2, 8])
    threshold = rng.randrange(0, 400)
    low = step * rng.randrange(1, 4)
    calls = []

    def fits(n):
        calls.append(n)
        return n <= threshold

    scan = [n for n in range(low, 2000, step) if fits(n)]
    calls.clear()
    expected = max(scan) if scan else None
    assert largest(fits, low, step * rng.randrange(1, 50), step) == expected
    assert all(n % step == 0 for n in calls)


def test_stage_counts():
    assert stage_counts(1) == [1]
    assert stage_counts(8) == [1, 2, 4, 8]
    assert stage_counts(6) == [1, 2, 4, 6]
    with pytest.raises(ConfigError, match="give at least 1"):
        stage_counts(0)


def test_each_row_fits_and_one_more_does_not():
    rows = capacity(MODEL, "num_layers", BUDGET, 4, overrides=SHAPED)
    assert [r["num_stages"] for r in rows] == [1, 2, 4]
    values = [r["value"] for r in rows]
    assert all(v is not None for v in values), rows
    for row in rows:
        k, value = row["num_stages"], row["value"]
        plan = plan_with(MODEL, "num_layers", value, k, BUDGET, overrides=SHAPED)
        assert plan["fits"] and plan["max_peak"] == row["max_peak"] and plan["params"] == row["params"]
        assert not plan_with(MODEL, "num_layers", value + 1, k, BUDGET, overrides=SHAPED)["fits"]
    assert values == sorted(values) and values[-1] > values[0], values  # more stages hold more layers
    text = format_capacity(MODEL, "num_layers", "8MiB", rows)
    assert text.splitlines()[0] == f"largest num_layers of {MODEL} that fits 8MiB per device (memory planner):"
    assert len(text.splitlines()) == 2 + len(rows)


def test_a_knob_that_is_not_an_integer_is_named_with_the_choices():
    with pytest.raises(ConfigError, match=r"'model_dim2' is not an integer knob of .*grow one of: .*num_layers"):
        capacity(MODEL, "model_dim2", BUDGET, 2, overrides=SHAPED)
    with pytest.raises(ConfigError, match="'remat' is not an integer knob"):
        capacity(MODEL, "remat", BUDGET, 2, overrides=SHAPED)


def test_a_batch_size_knob_proposes_only_batch_sizes_the_trainer_accepts():
    # issue 35 item 4: the search proposed batch sizes that M does not divide, which the trainer then refuses.
    model, replicas = "toy.classifier.BlobsMlpGPipe", 3
    overrides = f"train.num_replicas={replicas}"
    rows = capacity(model, "batch_size", BUDGET, 2, overrides=overrides)
    assert [r["num_stages"] for r in rows] == [1, 2] and all(r["value"] for r in rows), rows
    for row in rows:
        k, value = row["num_stages"], row["value"]
        params, _ = experiment.resolve_params(model, overrides=overrides,
                                              gin_bindings=[f"{model}.batch_size={value}", f"{model}.num_stages={k}"])
        assert params.input.train.batch_size == value
        # The trainer's own checks: an equal slice per replica, then M micro-batches of each slice.
        assert value % params.train.num_replicas == 0, row
        (_, pipe), = find_pipelines(params.task)
        microbatch.check_divisible(tf.zeros([value // replicas, 1]), pipe.num_micro_batches)
        multiple = replicas * pipe.num_micro_batches
        assert row["note"] == (f"multiples of {multiple}: batch sizes the trainer accepts "
                               f"(num_micro_batches={pipe.num_micro_batches} x {replicas} replicas)"), row
        # Still the largest that fits: the next accepted batch size does not.
        assert plan_with(model, "batch_size", value, k, BUDGET, overrides=overrides)["fits"]
        assert not plan_with(model, "batch_size", value + multiple, k, BUDGET, overrides=overrides)["fits"]
