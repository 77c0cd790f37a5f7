"""Toy experiments that need no data download: used by the quick start and the tests."""
