"""Benchmarks: `python -m bench.pipeline --help`."""
