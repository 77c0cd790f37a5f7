"""bench.memory_check: several fresh processes of one configuration combine into each device's largest peaks."""

import pytest

from bench import memory_check


def _run(tensors, allocator):
    return {"tensors": tensors, "measured": allocator, "predicted": [5, 6], "plan": {"devices": []}}


def test_largest_over_runs_takes_each_devices_largest_peaks_and_keeps_every_run():
    runs = [_run([176, 215], [200, 219]), _run([208, 203], [224, 219]), _run([192, 208], [203, 220])]
    combined = memory_check.largest_over_runs(runs)
    assert combined["tensors"] == [208, 215] and combined["measured"] == [224, 220]
    assert combined["tensors_runs"] == [[176, 215], [208, 203], [192, 208]]
    assert combined["allocator_runs"] == [[200, 219], [224, 219], [203, 220]]
    assert combined["predicted"] == [5, 6]


def test_largest_over_runs_refuses_no_runs_and_runs_of_different_devices():
    with pytest.raises(ValueError, match="one or more"):
        memory_check.largest_over_runs([])
    with pytest.raises(ValueError, match="same number of devices"):
        memory_check.largest_over_runs([_run([1, 2], [1, 2]), _run([1], [1])])


def test_spread_finds_the_devices_no_one_prediction_can_be_within_the_bound_of():
    rows = [{"config": "a", "device": 0, "tensors_runs": [176, 208]},  # 1.18x: beyond 1.10 / 0.95
            {"config": "a", "device": 1, "tensors_runs": [192, 208]},  # 1.083x
            {"config": "b", "device": 0, "tensors_runs": [64, 64]}]
    moved = memory_check.spread(rows, "tensors_runs")
    assert moved["widest"] is rows[0] and moved["ratio"] == pytest.approx(208 / 176)
    assert moved["moved"] == [rows[0]]
