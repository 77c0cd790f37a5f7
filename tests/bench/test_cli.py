"""bench.cli: the count flags (bench.pipeline --memory-processes, bench.memory_check --processes) take 1 and up."""

import argparse

import pytest

from bench.cli import positive_count


def test_a_count_flag_takes_counts_from_one() -> None:
    assert positive_count("3") == 3
    assert positive_count("1") == 1
    for bad in ("0", "-1", "three", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 1"):
            positive_count(bad)
