"""Sequence decoding independent of the model: greedy and beam search over a step function."""

from gpipe_tf.decoding.search import beam_search, greedy_search, length_penalty

__all__ = ["beam_search", "greedy_search", "length_penalty"]
