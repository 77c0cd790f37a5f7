"""The per-device memory figures of `bench.pipeline`: medians over fresh processes, and the lines that compare each
schedule's largest device with 1F1B's."""

from __future__ import annotations

import pytest

from bench import pipeline as bench_pipeline


def test_median_device_row_takes_each_devices_median_and_keeps_every_run() -> None:
    runs = [[170.1, 130.1, 110.1, 90.1], [166.1, 138.1, 108.1, 94.1], [176.1, 132.1, 118.1, 92.1]]
    row = bench_pipeline.median_device_row("one_f_one_b", runs)
    assert row["device_peak_memory_mb"] == [170.1, 132.1, 110.1, 92.1]
    assert row["device_peak_memory_runs_mb"] == runs
    assert (row["schedule"], row["k"], row["m"]) == ("one_f_one_b", 4, 16)


def test_median_device_row_refuses_runs_of_different_device_counts() -> None:
    with pytest.raises(ValueError, match="same number of devices"):
        bench_pipeline.median_device_row("zero_bubble_v", [[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError, match="one or more"):
        bench_pipeline.median_device_row("zero_bubble_v", [])


def test_device_memory_lines_compare_the_largest_devices_medians() -> None:
    rows = [bench_pipeline.median_device_row("one_f_one_b", [[170.0, 100.0], [174.0, 90.0], [166.0, 95.0]]),
            bench_pipeline.median_device_row("zero_bubble_v", [[178.0, 160.0], [180.0, 150.0], [179.0, 155.0]])]
    lines = bench_pipeline.device_memory_lines(rows)
    head = "peak memory per device K=4 M=16 no remat"
    assert lines[0] == f"{head} one_f_one_b: 170.0 / 95.0 MiB (medians of 3 processes)"
    assert lines[1] == f"{head} zero_bubble_v: 179.0 / 155.0 MiB (medians of 3 processes)"
    assert lines[2] == ("peak memory of the largest device K=4 M=16 no remat zero_bubble_v / one_f_one_b: "
                        "1.05 (179.0 / 170.0 MiB)")

