"""The loss-in-pipeline equivalence cases the schedule tests share: the model (an MLP deep enough for every
schedule), a weighted squared-error head handed to the pipeline as its loss, one training step's loss and
gradients, and the comparison with the un-pipelined model."""

import numpy as np
import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.interleaved import Interleaved
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.schedule_base import PipelineLoss
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.sequential import Sequential
from tests.helpers.pipeline_models import BATCH, DEVICES

DEPTH = 12  # Interleaved v=3 at K=4 needs 12 chunks


def schedule_params(name, v=None):
    if name == "interleaved":
        return Interleaved.params().set(virtual_stages=v)
    return name


def build(layers, dtype, k=None, m=1, remat="never", schedule="fill_drain", jit_compile=False):
    if k is None:
        return Sequential.params().set(name="net", dtype=dtype, layers=layers).instantiate()
    return GPipe.params().set(name="net", dtype=dtype, layers=layers, num_stages=k, num_micro_batches=m, remat=remat,
                              devices=DEVICES[:k], schedule=schedule, jit_compile=jit_compile).instantiate()


def head_fn(head, out, targets, ctx):
    """A weighted squared error of a projection of every output leaf (in the head's dtype): sums, as PipelineLoss
    asks."""
    y = tf.add_n([tf.reduce_sum(tf.cast(tf.reshape(t, [t.shape[0], -1]), head[0].dtype)
                                * head[0][:int(np.prod(t.shape[1:]))], -1)
                  for t in tf.nest.flatten(out)])
    return {"loss": tf.reduce_sum(targets["w"] * (y - targets["y"]) ** 2), "count": tf.reduce_sum(targets["w"])}


def loss_and_grads(layer, x, targets, head, seed=None):
    """The mean loss and gradients (layer variables, then the head) of one training step."""
    @tf.function(autograph=False)
    def step(x):
        ctx = FPropContext(training=True, seed=seed)
        with tf.GradientTape() as tape:
            if isinstance(layer, GPipe):
                normalizer = tf.reduce_sum(targets["w"])
                loss = PipelineLoss(head_fn, (head,), targets, tf.cast(1.0 / normalizer, tf.float32))
                sums = layer.fprop_with_loss(layer.theta, x, loss, ctx)
            else:
                sums = head_fn([head], layer.fprop(layer.theta, x, ctx), targets, ctx)
            mean = sums["loss"] / sums["count"]
        with placement.colocate_gradients():
            grads = tape.gradient(mean, list(layer.trainable_variables) + [head])
        return mean, grads

    mean, grads = step(x)
    return float(mean), [g.numpy() for g in grads]


def assert_same(got, ref, rtol, atol):
    np.testing.assert_allclose(got[0], ref[0], rtol=rtol, atol=atol)
    assert len(got[1]) == len(ref[1])
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"gradient {i}")


def data(dtype, size=6, seed=1):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(BATCH, size)).astype(dtype))
    targets = {"y": tf.constant(rng.normal(size=(BATCH,)).astype(dtype)),
               "w": tf.constant(rng.uniform(size=(BATCH,)).astype(dtype))}
    head = tf.Variable(rng.normal(size=(size,)).astype(dtype))
    return x, targets, head


# M in {1, 2, 4, 8} that K divides (K=3 divides none of them: 3 and 6 instead).
INTERLEAVED = [(k, m) for k in (1, 2, 4) for m in (1, 2, 4, 8) if m % k == 0] + [(3, 3), (3, 6)]
