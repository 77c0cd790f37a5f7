"""Greedy and beam search over toy step functions whose best sequences are known by construction or enumeration."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.decoding import beam_search, greedy_search, length_penalty

BOS, EOS = 0, 1
A, B, C, D = 2, 3, 4, 5

# ----------------------------------------------------------------------------------------------- helpers


def table(vocab, max_length, rows):
    """Log-probabilities [max_length, vocab (previous token), vocab (next token)].

    `rows` maps (t, prev) -> {token: prob}, t None meaning every step; within a given row the tokens not named
    share what is left of the probability; rows not given are uniform.
    """
    probs = np.full((max_length, vocab, vocab), 1.0 / vocab)
    for (t, prev), given in rows.items():
        steps = range(max_length) if t is None else [t]
        row = np.full(vocab, (1.0 - sum(given.values())) / (vocab - len(given)))
        for token, p in given.items():
            row[token] = p
        assert np.all(row > 0) and abs(row.sum() - 1.0) < 1e-12
        for s in steps:
            probs[s, prev] = row
    return np.log(probs)


def table_step_fn(tables, counter=None):
    """step_fn over per-row tables [num_tables, L, V, V]: state["table"] [N] picks each row's table."""
    tables = tf.constant(tables)

    def step_fn(ids_t, state, t):
        if counter is not None:
            counter.assign_add(1)
        index = tf.stack([state["table"], tf.fill(tf.shape(ids_t), t), ids_t], axis=1)
        return tf.gather_nd(tables, index), {"table": state["table"], "steps": state["steps"] + 1}

    return step_fn


def table_state(table_ids):
    return {"table": tf.constant(table_ids, tf.int32), "steps": tf.zeros([len(table_ids)], tf.int32)}


def np_lp(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def enumerate_best(log_prob_fn, vocab, max_length, alpha):
    """Every sequence (ending at its first EOS or cut at max_length), scored and sorted best first."""
    results = []

    def grow(prefix, total):
        log_probs = log_prob_fn(prefix)
        for token in range(vocab):
            seq, score = prefix + (token,), total + log_probs[token]
            if token == EOS or len(seq) == max_length:
                results.append((score / np_lp(len(seq), alpha), seq))
            else:
                grow(seq, score)

    grow((), 0.0)
    return sorted(results, key=lambda r: -r[0])


def table_log_prob_fn(logp):
    return lambda prefix: logp[len(prefix), prefix[-1] if prefix else BOS]


def padded(seq, max_length, pad=EOS):
    return list(seq) + [pad] * (max_length - len(seq))


def sequence_log_prob(log_prob_fn, seq):
    """Log-probability of `seq` up to and including its first EOS, and that length."""
    seq = list(seq)
    length = seq.index(EOS) + 1 if EOS in seq else len(seq)
    return sum(log_prob_fn(tuple(seq[:t]))[seq[t]] for t in range(length)), length


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_returns_each_rows_known_best_sequence_and_stops_early():
    max_length = 6
    chain0 = table(6, max_length, {(None, BOS): {A: 0.7}, (None, A): {B: 0.7}, (None, B): {C: 0.7},
                                   (None, C): {EOS: 0.7}})
    chain1 = table(6, max_length, {(None, BOS): {C: 0.7}, (None, C): {A: 0.7}, (None, A): {EOS: 0.7}})
    for logp, best in ((chain0, (A, B, C, EOS)), (chain1, (C, A, EOS))):
        assert enumerate_best(table_log_prob_fn(logp), 6, max_length, 0.0)[0][1] == best
    counter = tf.Variable(0)
    step_fn = table_step_fn(np.stack([chain0, chain1]), counter)
    expected = [padded((A, B, C, EOS), max_length), padded((C, A, EOS), max_length)]
    ids = greedy_search(step_fn, table_state([0, 1]), 2, max_length, BOS, EOS)
    assert ids.dtype == tf.int32
    np.testing.assert_array_equal(ids.numpy(), expected)
    # Both rows have ended after 4 steps; the remaining 2 are not run.
    assert int(counter.numpy()) == 4

    run = tf.function(lambda state: greedy_search(step_fn, state, 2, max_length, BOS, EOS, pad_id=0), autograph=False)
    np.testing.assert_array_equal(run(table_state([1, 0])).numpy(),
                                  [padded((C, A, EOS), max_length, 0), padded((A, B, C, EOS), max_length, 0)])


def test_greedy_cuts_rows_that_never_end_at_max_length():
    loop = table(4, 3, {(None, BOS): {A: 0.9}, (None, A): {A: 0.9}})
    ids = greedy_search(table_step_fn(loop[None]), table_state([0]), 1, 3, BOS, EOS)
    np.testing.assert_array_equal(ids.numpy(), [[A, A, A]])


# ------------------------------------------------------------------------------------------------ beam


MYOPIC = {(None, BOS): {A: 0.55, B: 0.40}, (None, A): {EOS: 0.34, C: 0.33, D: 0.32}, (None, B): {EOS: 0.9}}


def test_beam_search_beats_myopic_greedy_and_stops_early():
    max_length = 8
    logp = table(6, max_length, MYOPIC)
    counter = tf.Variable(0)
    step_fn = table_step_fn(logp[None], counter)
    greedy = greedy_search(step_fn, table_state([0]), 1, max_length, BOS, EOS).numpy()
    np.testing.assert_array_equal(greedy, [padded((A, EOS), max_length)])
    counter.assign(0)
    ids, scores = beam_search(step_fn, table_state([0]), 1, 2, max_length, BOS, EOS, 0.0, dtype=tf.float64)
    np.testing.assert_array_equal(ids.numpy()[0], [padded((B, EOS), max_length), padded((A, EOS), max_length)])
    np.testing.assert_allclose(scores.numpy()[0], [np.log(0.40 * 0.9), np.log(0.55 * 0.34)], rtol=1e-12)
    greedy_log_prob, _ = sequence_log_prob(table_log_prob_fn(logp), greedy[0])
    assert scores.numpy()[0, 0] > greedy_log_prob
    assert enumerate_best(table_log_prob_fn(logp), 6, 4, 0.0)[0][1] == (B, EOS)
    # After 2 steps both finished hypotheses beat every running one (A C, A D), whatever follows.
    assert int(counter.numpy()) == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_beam_size_one_equals_greedy(seed):
    rng = np.random.default_rng(seed)
    max_length, vocab = 6, 5
    logits = 2.0 * rng.normal(size=(4, max_length, vocab, vocab))
    logits[..., EOS] -= 2.0  # so that some rows run to max_length
    tables = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tables = np.concatenate([tables, table(vocab, max_length, {(None, BOS): {A: 0.55, B: 0.4},
                                                               (None, A): {EOS: 0.5}})[None]])
    step_fn = table_step_fn(tables)
    state = table_state(range(5))
    greedy = greedy_search(step_fn, state, 5, max_length, BOS, EOS).numpy()
    ids, scores = tf.function(lambda s: beam_search(step_fn, s, 5, 1, max_length, BOS, EOS, 0.0,
                                                    dtype=tf.float64), autograph=False)(state)
    np.testing.assert_array_equal(ids.numpy()[:, 0], greedy)
    assert np.any(greedy[:, -1] != EOS) and np.any(greedy[:, -1] == EOS)
    for row in range(5):
        log_prob, _ = sequence_log_prob(table_log_prob_fn(tables[row]), greedy[row])
        np.testing.assert_allclose(scores.numpy()[row, 0], log_prob, rtol=1e-12)


def test_length_penalty_changes_the_ranking():
    max_length, vocab = 4, 4
    # Short: A EOS with log-probability -1.0. Long: B B B EOS with -1.2, but better per token.
    p_b = np.exp((-1.2 - np.log(0.45)) / 3.0)
    logp = table(vocab, max_length, {
        (0, BOS): {A: 0.5, B: 0.45},
        (1, A): {EOS: np.exp(-1.0) / 0.5},
        (1, B): {B: p_b, EOS: 0.01}, (2, B): {B: p_b, EOS: 0.01}, (3, B): {EOS: p_b}})
    fn = table_log_prob_fn(logp)
    short, long = (A, EOS), (B, B, B, EOS)
    np.testing.assert_allclose([sequence_log_prob(fn, short)[0], sequence_log_prob(fn, long)[0]], [-1.0, -1.2],
                               rtol=1e-12)
    step_fn = table_step_fn(logp[None])
    run = tf.function(lambda alpha: beam_search(step_fn, table_state([0]), 1, 2, max_length, BOS, EOS, alpha,
                                                dtype=tf.float64), autograph=False)
    for alpha, best, other in ((0.0, short, long), (1.0, long, short)):
        ids, scores = beam_search(step_fn, table_state([0]), 1, 2, max_length, BOS, EOS, alpha, dtype=tf.float64)
        assert tuple(ids.numpy()[0, 0][:len(best)]) == best
        assert enumerate_best(fn, vocab, max_length, alpha)[0][1] == best
        # Finished hypotheses keep the score they finished with: log P / lp(their length).
        log_prob, length = sequence_log_prob(fn, best)
        np.testing.assert_allclose(scores.numpy()[0, 0], log_prob / np_lp(length, alpha), rtol=1e-12)
        np.testing.assert_allclose(length_penalty(length, alpha, tf.float64).numpy(), np_lp(length, alpha))
        assert sequence_log_prob(fn, best)[0] / np_lp(len(best), alpha) > \
            sequence_log_prob(fn, other)[0] / np_lp(len(other), alpha)
        graph_ids, graph_scores = run(alpha)
        np.testing.assert_array_equal(graph_ids.numpy(), ids.numpy())
        np.testing.assert_allclose(graph_scores.numpy(), scores.numpy(), rtol=1e-12)


def history_model(vocab, max_length, seed):
    """A non-Markov model: the next token's log-probabilities depend on the whole prefix, read from the state."""
    rng = np.random.default_rng(seed)
    num_rows = 97
    logits = 2.0 * rng.normal(size=(num_rows, vocab))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    weights = np.array([3, 7, 11, 13, 17, 19, 23, 29][:max_length])

    def np_fn(prefix):
        history = np.zeros(max_length, np.int64)
        history[:len(prefix)] = prefix
        return logp[(history @ weights + 31 * len(prefix)) % num_rows]

    tf_logp, tf_weights = tf.constant(logp), tf.constant(weights, tf.int32)

    def step_fn(ids_t, state, t):
        # The previous token joins the history kept in the state: with wrong reordering, a beam would read
        # another beam's history and its log-probabilities would no longer match its own prefix.
        history = tf.where(tf.equal(tf.range(max_length), t - 1), ids_t[:, tf.newaxis], state["history"])
        index = (tf.reduce_sum(history * tf_weights, axis=1) + 31 * t) % num_rows
        return tf.gather(tf_logp, index), {"history": history}

    return np_fn, step_fn


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_search_reorders_the_state_with_its_beams(alpha):
    vocab, max_length, beam, batch = 5, 5, 4, 2
    models = [history_model(vocab, max_length, seed) for seed in (3, 4)]

    def step_fn(ids_t, state, t):
        # Rows of batch entry 0 use model 0, those of entry 1 model 1 (the entry travels in the state too).
        lp0, s0 = models[0][1](ids_t, state, t)
        lp1, _ = models[1][1](ids_t, state, t)
        return tf.where(tf.equal(state["entry"], 0)[:, tf.newaxis], lp0, lp1), {**s0, "entry": state["entry"]}

    state = {"history": tf.zeros([batch, max_length], tf.int32), "entry": tf.constant([0, 1])}
    ids, scores = tf.function(lambda s: beam_search(step_fn, s, batch, beam, max_length, BOS, EOS, alpha,
                                                    dtype=tf.float64), autograph=False)(state)
    ids, scores = ids.numpy(), scores.numpy()
    for entry in range(batch):
        np_fn = models[entry][0]
        assert len({tuple(h) for h in ids[entry]}) == beam
        assert np.all(np.diff(scores[entry]) <= 0)
        for k in range(beam):
            log_prob, length = sequence_log_prob(np_fn, ids[entry, k])
            np.testing.assert_allclose(scores[entry, k], log_prob / np_lp(length, alpha), rtol=1e-12)
            assert np.all(ids[entry, k, length:] == EOS)
        best_score, best_seq = enumerate_best(np_fn, vocab, max_length, alpha)[0]
        np.testing.assert_array_equal(ids[entry, 0], padded(best_seq, max_length))
        np.testing.assert_allclose(scores[entry, 0], best_score, rtol=1e-12)


def test_search_arguments_are_checked():
    logp = table(4, 3, {})
    step_fn = table_step_fn(logp[None])
    with pytest.raises(TypeError, match="dtype='float64'"):
        beam_search(step_fn, table_state([0]), 1, 2, 3, BOS, EOS)
    with pytest.raises(ValueError, match="beam_size must be >= 1"):
        beam_search(step_fn, table_state([0]), 1, 0, 3, BOS, EOS, dtype=tf.float64)
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        greedy_search(step_fn, table_state([0]), 1, 0, BOS, EOS)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        beam_search(lambda ids, s, t: (tf.zeros([2, 1], tf.float64), s), table_state([0]), 1, 2, 3, BOS, EOS,
                    dtype=tf.float64)
    with pytest.raises(ValueError, match="leading dimension batch_size = 2"):
        greedy_search(step_fn, table_state([0, 0, 0]), 2, 3, BOS, EOS)
    with pytest.raises(ValueError, match="expected batch_size = 2"):
        greedy_search(lambda ids, s, t: (tf.zeros([3, 4]), s), table_state([0, 0]), 2, 3, BOS, EOS)
