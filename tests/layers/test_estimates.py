"""`estimates.memoized`: inside it a layer's estimate on one input spec is computed once; outside, every time."""

import tensorflow as tf

from gpipe_tf.layers import estimates
from gpipe_tf.layers.linear import Linear

CALLS = []


class CountingLinear(Linear):
    """A Linear that records each flops estimate it computes."""

    @classmethod
    def flops(cls, p, input_spec):
        CALLS.append(tuple(input_spec.shape))
        return super().flops(p, input_spec)


def test_each_layer_and_spec_is_estimated_once_inside_the_scope_only():
    CALLS.clear()
    a = CountingLinear.params().set(input_dim=4, output_dim=3)
    b = a.copy()  # an equal but distinct Params: answered on its own
    small, large = tf.TensorSpec([2, 4]), tf.TensorSpec([8, 4])
    with estimates.memoized():
        values = [estimates.estimate(lp, "flops", spec) for lp in (a, a, b) for spec in (small, large, small)]
        with estimates.memoized():  # a nested scope shares the outer answers
            assert estimates.estimate(a, "flops", large) == 2 * 8 * 4 * 3
    assert values == [2 * 2 * 4 * 3, 2 * 8 * 4 * 3, 2 * 2 * 4 * 3] * 3
    assert CALLS == [(2, 4), (8, 4), (2, 4), (8, 4)]
    estimates.estimate(a, "flops", small)
    estimates.estimate(a, "flops", small)
    assert len(CALLS) == 6  # outside the scope nothing is kept
