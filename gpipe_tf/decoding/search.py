"""Greedy and beam search over a model-independent step function, as `tf.while_loop`s with static shapes.

The model is seen only through

    step_fn(ids_t [N] int32, state, t) -> (log_probs [N, V], new_state)

where `ids_t` holds the previous token of each of N running hypotheses (`bos_id` at t = 0), `t` is the position
being predicted (an int32 scalar tensor), `log_probs` are normalized log-probabilities of the token at position t,
and `state` is any nested structure of tensors whose leading dimension is N (e.g. a decoder's key/value caches and
the encoder output). N is batch_size for greedy search and batch_size * beam_size for beam search, whose rows are
ordered hypothesis-major within each batch entry: row b * beam_size + k is beam k of entry b. `new_state` must have
the same structure and shapes as `state` (the loop state of a `tf.while_loop`): keep fixed-size buffers.

Outputs hold the generated tokens only (no BOS), max_length columns: a hypothesis's tokens up to and including
its first EOS, then `pad_id` (default: `eos_id`). Both searches stop early once no running hypothesis can change
the result, and both run eagerly or inside `tf.function`.

Scores are GNMT's: log P(y) / lp(|y|) with lp(n) = ((5 + n) / 6) ** alpha, |y| counting the generated tokens
including EOS. A hypothesis still running at max_length is scored as if it ended there (length max_length).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

StepFn = Callable[[tf.Tensor, Any, tf.Tensor], tuple[tf.Tensor, Any]]


def length_penalty(length: int | tf.Tensor, alpha: float | tf.Tensor,
                   dtype: tf.DType | str = tf.float32) -> tf.Tensor:
    """GNMT's length penalty ((5 + length) / 6) ** alpha, in `dtype`."""
    # tf.constant for Python numbers: tf.cast of a Python float goes through float32 and would round alpha.
    alpha = tf.cast(alpha, dtype) if isinstance(alpha, (tf.Tensor, tf.Variable)) else tf.constant(alpha, dtype)
    return ((5.0 + tf.cast(length, dtype)) / 6.0) ** alpha


def _check_sizes(batch_size: int, max_length: int, beam_size: int = 1) -> None:
    for name, value in (("batch_size", batch_size), ("max_length", max_length), ("beam_size", beam_size)):
        if isinstance(value, int) and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_state(state: Any, batch_size: Any) -> None:
    """Every leaf of `state` must have batch_size rows (checked where both are static)."""
    if not isinstance(batch_size, int):
        return
    for leaf in tf.nest.flatten(state):
        leaf = tf.convert_to_tensor(leaf)
        if leaf.shape.rank == 0 or (leaf.shape.rank and leaf.shape[0] is not None and leaf.shape[0] != batch_size):
            raise ValueError(f"every leaf of initial_state needs leading dimension batch_size = {batch_size}, got "
                             f"shape {leaf.shape}")


def _check_log_probs(log_probs: tf.Tensor, rows: Any, what: str) -> tf.Tensor:
    log_probs = tf.convert_to_tensor(log_probs)
    if log_probs.shape.rank is not None and log_probs.shape.rank != 2:
        raise ValueError(f"step_fn must return log_probs of shape [{what}, vocab], got {log_probs.shape}")
    if isinstance(rows, int) and log_probs.shape[0] is not None and log_probs.shape[0] != rows:
        raise ValueError(f"step_fn returned {log_probs.shape[0]} rows of log_probs, expected {what} = {rows}")
    return log_probs


def greedy_search(step_fn: StepFn, initial_state: Any, batch_size: int, max_length: int, bos_id: int,
                  eos_id: int, pad_id: int | None = None) -> tf.Tensor:
    """Picks the most probable token at every step: returns ids [batch_size, max_length] int32.

    `initial_state` has leading dimension batch_size. Rows that have emitted EOS feed `pad_id` to `step_fn`
    afterwards and their outputs are ignored; the loop stops when every row has emitted EOS. Ties go to the
    lowest token id.
    """
    _check_sizes(batch_size, max_length)
    _check_state(initial_state, batch_size)
    pad = eos_id if pad_id is None else pad_id

    def cond(t: tf.Tensor, ids_t: tf.Tensor, finished: tf.Tensor, state: Any, out: tf.Tensor) -> tf.Tensor:
        return tf.logical_and(t < max_length, tf.logical_not(tf.reduce_all(finished)))

    def body(t: tf.Tensor, ids_t: tf.Tensor, finished: tf.Tensor, state: Any, out: tf.Tensor) -> tuple:
        log_probs, new_state = step_fn(ids_t, state, t)
        log_probs = _check_log_probs(log_probs, batch_size, "batch_size")
        # top_k, unlike argmax, guarantees the lowest index among ties, so beam_size=1 picks the same tokens.
        token = tf.cast(tf.math.top_k(log_probs, 1).indices[:, 0], tf.int32)
        token = tf.where(finished, pad, token)
        # Time-major buffer: step t writes one row.
        out = tf.tensor_scatter_nd_update(out, tf.reshape(t, [1, 1]), token[tf.newaxis])
        return t + 1, token, tf.logical_or(finished, tf.equal(token, eos_id)), new_state, out

    loop_vars = (tf.constant(0, tf.int32), tf.fill([batch_size], tf.constant(bos_id, tf.int32)),
                 tf.zeros([batch_size], tf.bool), initial_state,
                 tf.fill([max_length, batch_size], tf.constant(pad, tf.int32)))
    out = tf.while_loop(cond, body, loop_vars, maximum_iterations=max_length)[-1]
    return tf.transpose(out)


def beam_search(step_fn: StepFn, initial_state: Any, batch_size: int, beam_size: int, max_length: int,
                bos_id: int, eos_id: int, length_penalty_alpha: float = 0.0, pad_id: int | None = None,
                dtype: tf.DType | str = tf.float32) -> tuple[tf.Tensor, tf.Tensor]:
    """Beam search: returns (ids [batch_size, beam_size, max_length] int32, scores [batch_size, beam_size]).

    Hypotheses of each batch entry come best first; scores are length-normalized log-probabilities (module doc),
    -inf for slots no hypothesis filled. `initial_state` has leading dimension batch_size: it is tiled to
    batch_size * beam_size rows, and after every step each leaf is reordered with `tf.gather` so that row
    b * beam_size + k follows the hypothesis now in beam k. `dtype` is the dtype of step_fn's log_probs.
    `length_penalty_alpha` is a Python number (its sign picks the stopping bound when the loop is built).

    Each step scores all extensions of the beam_size running ("alive") hypotheses and keeps the 2 * beam_size
    best. Those ending in EOS that rank among the first beam_size join the finished set, which keeps the
    beam_size best-scoring finished hypotheses with the scores they had when they finished; the best beam_size
    that do not end in EOS become the new alive beam (at most beam_size of the 2 * beam_size end in EOS, one per
    parent, so there are always enough). With beam_size=1 and alpha=0 this returns greedy search's sequence.

    The loop stops early when, for every batch entry, the worst finished score is at least the best score an
    alive hypothesis could still reach: its log-probability (which can only fall, log_probs <= 0) over the largest
    length penalty of the lengths it may still end at. Stopping then gives the same result as running on.
    """
    _check_sizes(batch_size, max_length, beam_size)
    _check_state(initial_state, batch_size)
    dtype = tf.as_dtype(dtype)
    pad = eos_id if pad_id is None else pad_id
    k = beam_size
    neg_inf = tf.constant(float("-inf"), dtype)
    alpha = float(length_penalty_alpha)

    def lp(length: Any) -> tf.Tensor:
        return length_penalty(length, alpha, dtype)

    def write_column(seqs: tf.Tensor, t: tf.Tensor, tokens: tf.Tensor) -> tf.Tensor:
        """seqs [B, n, L] with column t replaced by tokens [B, n]."""
        at_t = tf.equal(tf.range(max_length), t)
        return tf.where(at_t, tokens[..., tf.newaxis], seqs)

    def cond(t: tf.Tensor, ids_t: tf.Tensor, alive_seq: tf.Tensor, alive_logp: tf.Tensor, fin_seq: tf.Tensor,
             fin_scores: tf.Tensor, state: Any) -> tf.Tensor:
        # Alive hypotheses hold t tokens and may still end at lengths t+1 .. max_length (or be cut at
        # max_length); dividing a negative log-probability by the largest of those penalties gives its best score.
        max_lp = lp(max_length) if alpha >= 0 else lp(t + 1)
        best_alive = tf.reduce_max(alive_logp, axis=1) / max_lp
        done = tf.reduce_min(fin_scores, axis=1) >= best_alive
        return tf.logical_and(t < max_length, tf.logical_not(tf.reduce_all(done)))

    def body(t: tf.Tensor, ids_t: tf.Tensor, alive_seq: tf.Tensor, alive_logp: tf.Tensor, fin_seq: tf.Tensor,
             fin_scores: tf.Tensor, state: Any) -> tuple:
        log_probs, new_state = step_fn(ids_t, state, t)
        log_probs = _check_log_probs(log_probs, batch_size * k if isinstance(batch_size, int) else None,
                                     "batch_size * beam_size")
        if log_probs.dtype != dtype:
            raise TypeError(f"step_fn returned {log_probs.dtype.name} log_probs; pass dtype={log_probs.dtype.name!r} "
                            "to beam_search")
        if log_probs.shape[-1] is not None and log_probs.shape[-1] < 2:
            raise ValueError(f"beam search needs a vocabulary of at least 2 tokens, got {log_probs.shape[-1]}")
        vocab = tf.shape(log_probs)[-1]
        scores = alive_logp[:, :, tf.newaxis] + tf.reshape(log_probs, [batch_size, k, vocab])
        top_logp, top_index = tf.math.top_k(tf.reshape(scores, [batch_size, k * vocab]), 2 * k)
        parent = top_index // vocab
        token = tf.cast(top_index % vocab, tf.int32)
        cand_seq = write_column(tf.gather(alive_seq, parent, batch_dims=1), t, token)
        is_eos = tf.equal(token, eos_id)

        # Finished: the beam's EOS extensions (ranked within the first k), merged with earlier finished ones.
        # Earlier ones come first, and top_k prefers lower indices on ties, so a tie keeps the earlier hypothesis.
        in_beam = tf.range(2 * k) < k
        new_fin = tf.where(tf.logical_and(is_eos, in_beam), top_logp / lp(t + 1), neg_inf)
        fin_scores, fin_index = tf.math.top_k(tf.concat([fin_scores, new_fin], axis=1), k)
        fin_seq = tf.gather(tf.concat([fin_seq, cand_seq], axis=1), fin_index, batch_dims=1)

        # Alive: the k best extensions that did not end.
        alive_logp, alive_index = tf.math.top_k(tf.where(is_eos, neg_inf, top_logp), k)
        alive_seq = tf.gather(cand_seq, alive_index, batch_dims=1)
        rows = tf.gather(parent, alive_index, batch_dims=1) + tf.range(batch_size)[:, tf.newaxis] * k
        state = tf.nest.map_structure(lambda s: tf.gather(s, tf.reshape(rows, [-1])), new_state)
        ids_t = tf.reshape(tf.gather(token, alive_index, batch_dims=1), [-1])
        return t + 1, ids_t, alive_seq, alive_logp, fin_seq, fin_scores, state

    # Only beam 0 starts alive: k identical copies would fill the beam with duplicates of the same hypotheses.
    first = tf.concat([tf.zeros([1], dtype), tf.fill([k - 1], neg_inf)], axis=0)
    loop_vars = (tf.constant(0, tf.int32),
                 tf.fill([batch_size * k], tf.constant(bos_id, tf.int32)),
                 tf.fill([batch_size, k, max_length], tf.constant(pad, tf.int32)),
                 tf.tile(first[tf.newaxis], [batch_size, 1]),
                 tf.fill([batch_size, k, max_length], tf.constant(pad, tf.int32)),
                 tf.fill([batch_size, k], neg_inf),
                 tf.nest.map_structure(lambda s: tf.repeat(s, k, axis=0), initial_state))
    t, _, alive_seq, alive_logp, fin_seq, fin_scores, _ = tf.while_loop(
        cond, body, loop_vars, maximum_iterations=max_length)
    # Hypotheses cut at max_length compete with the finished ones. After an early stop they cannot beat any of
    # them and are left out.
    alive_scores = tf.where(t >= max_length, alive_logp / lp(max_length), neg_inf)
    scores, index = tf.math.top_k(tf.concat([fin_scores, alive_scores], axis=1), k)
    ids = tf.gather(tf.concat([fin_seq, alive_seq], axis=1), index, batch_dims=1)
    return ids, scores
