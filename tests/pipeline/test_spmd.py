"""The SPMD pipeline: a uniform Transformer stack's stages as one program over a stage axis equals FillDrain under
jit_compile on one CPU device, its graph does not grow with M, and the stacks it cannot run are refused."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from tests.helpers.pipeline_models import DEVICES, count_ops

ONE_DEVICE = [DEVICES[0]] * 4


class Halve(BaseLayer):
    """Keeps every other feature: a stage of these passes on half the features it gets."""

    def fprop(self, theta, inputs, ctx):
        return inputs[:, ::2]

    @classmethod
    def num_params(cls, p):
        return 0


def stack(schedule, m=8, depth=8, dropout=0.0, balance=None, layers=None):
    layer = TransformerEncoderLayer.params().set(model_dim=16, num_heads=2, hidden_dim=32, dropout_rate=dropout)
    return GPipe.params().set(name="net", dtype="float32", layers=layers or [layer.copy() for _ in range(depth)],
                              num_stages=4, num_micro_batches=m, devices=ONE_DEVICE, schedule=schedule,
                              balance=balance).instantiate()


def step_of(net, seed=None):
    def step(x):
        with tf.GradientTape() as tape:
            out = net.fprop(net.theta, x, FPropContext(training=True, seed=seed))
            loss = tf.reduce_sum(out * out)
        return loss, tape.gradient(loss, net.trainable_variables)
    return step


X = tf.constant(np.random.default_rng(1).normal(size=(16, 5, 16)).astype("float32"))


def test_equals_fill_drain_under_jit_compile_on_one_device():
    results = [tf.function(step_of(stack(s)), jit_compile=True, autograph=False)(X) for s in ("fill_drain", "spmd")]
    (loss, grads), (spmd_loss, spmd_grads) = results
    np.testing.assert_allclose(float(spmd_loss), float(loss), rtol=1e-5)
    # Relative to the largest gradient: a key bias's gradient is zero up to rounding (softmax ignores it).
    scale = max(float(tf.reduce_max(tf.abs(g))) for g in grads)
    assert len(spmd_grads) == len(grads) == 8 * 16
    for g, h in zip(grads, spmd_grads):
        np.testing.assert_allclose(h.numpy(), g.numpy(), rtol=1e-5, atol=1e-5 * scale)


def test_the_graph_does_not_grow_with_m():
    """Micro-batches of one sequence each, M from 2 to 8: one loop body whatever M. (TensorFlow makes a zeros
    tensor of over 1,000 elements with one more op than a smaller one, so the batch stays below that.)"""
    sizes = [count_ops(tf.function(step_of(stack("spmd", m)), autograph=False).get_concrete_function(
        tf.TensorSpec([m, 5, 16])).graph) for m in (2, 4, 8)]
    assert len(set(sizes)) == 1, sizes


def test_stacks_it_cannot_run_are_refused():
    with pytest.raises(ParamsError, match=r"stage 1's weights differ from stage 0's .* balance the stack"):
        tf.function(step_of(stack("spmd", balance=[1, 3, 2, 2])), autograph=False).get_concrete_function(X)
    with pytest.raises(ParamsError, match=r"every stage would draw stage 0's random numbers; set the stack's "
                                          r"dropout rates to 0"):
        tf.function(step_of(stack("spmd", dropout=0.1), tf.constant([1, 2], tf.int64)),
                    autograph=False).get_concrete_function(X)
    narrowing = [Linear.params().set(input_dim=6 - i, output_dim=5 - i) for i in range(4)]
    with pytest.raises(ParamsError, match=r"stage 1's weights differ from stage 0's"):
        tf.function(step_of(stack("spmd", layers=narrowing)), autograph=False).get_concrete_function(tf.zeros([8, 6]))
    halving = [Halve.params() for _ in range(4)]  # no weights, so the same in every stage
    with pytest.raises(ParamsError, match=r"a stage must keep its input's shape"):
        tf.function(step_of(stack("spmd", layers=halving)), autograph=False).get_concrete_function(tf.zeros([8, 16]))
