"""Argument types the benchmarks' command lines share."""

from __future__ import annotations

import argparse


def positive_count(text: str) -> int:
    """An integer flag that must be at least 1 (a count of processes, steps, repeats)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1; give a count such as 3")
    return value
