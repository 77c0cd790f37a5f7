"""Batch norm: micro-batch statistics in the pipeline, moving averages once per step from the full batch."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.schedules import SCHEDULES
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.batch_norm import BatchNorm
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.sequential import Sequential
from gpipe_tf.tasks.classifier import ClassifierTask
from gpipe_tf.training.learner import Learner, training_params
from tests.helpers import tiers

B, M, D = 16, 4, 5
RNG = np.random.default_rng(7)


def bn_np(x, eps=1e-5):
    mean, var = x.mean(0), x.var(0)
    return (x - mean) / np.sqrt(var + eps), mean, var


def test_batch_norm_layer_train_and_eval_match_numpy():
    layer = BatchNorm.params().set(dim=D, dtype="float64").instantiate()
    x = RNG.normal(size=(B, D)) * 2 + 1
    aux = {}
    out = layer.fprop(layer.theta, tf.constant(x), FPropContext(training=True, aux=aux))
    np.testing.assert_allclose(out.numpy(), bn_np(x)[0], rtol=1e-10, atol=1e-12)
    total, total_sq, count = (t.numpy() for t in aux[layer.path])
    np.testing.assert_allclose(total, x.sum(0), rtol=1e-12)
    np.testing.assert_allclose(total_sq, (x * x).sum(0), rtol=1e-12)
    assert count == B
    layer.vars["moving_mean"].assign(np.arange(D, dtype=np.float64))
    layer.vars["moving_variance"].assign(np.full(D, 4.0))
    out = layer(tf.constant(x))  # eval: moving statistics
    np.testing.assert_allclose(out.numpy(), (x - np.arange(D)) / np.sqrt(4.0 + 1e-5), rtol=1e-10)


def layers():
    return [Linear.params().set(input_dim=D, output_dim=D), BatchNorm.params().set(dim=D, decay=0.5),
            Linear.params().set(input_dim=D, output_dim=D, activation="tanh"), BatchNorm.params().set(dim=D, decay=0.5)]


def make_task(network):
    p = ClassifierTask.params().set(name="task", dtype="float64", network=network)
    p.softmax.set(input_dim=D, num_classes=3)
    return p.instantiate()


SCHEDULE_REMAT = [(schedule, remat) for schedule in ["fill_drain", "one_f_one_b", "interleaved", "zero_bubble_v",
                                                      ("fill_drain", True), ("zero_bubble", True)]
                  for remat in ("never", "always")]


@pytest.mark.parametrize("schedule,remat", tiers.sample(
    SCHEDULE_REMAT, keep=[("fill_drain", "always"), ("interleaved", "never"), ("zero_bubble_v", "always"),
                          (("zero_bubble", True), "never")]))
def test_moving_averages_after_one_pipelined_step_use_full_batch_statistics(remat, schedule):
    if isinstance(schedule, tuple):  # with batched weight gradients
        schedule = SCHEDULES[schedule[0]].params().set(batch_weight_gradients=schedule[1])
    network = GPipe.params().set(layers=layers(), num_stages=2, num_micro_batches=M, remat=remat,
                                 devices=["/device:CPU:0", "/device:CPU:1"], schedule=schedule)
    task = make_task(network)
    w = [task.network.children[f"layer_{j}"].vars for j in (0, 2)]
    w1, b1, w2, b2 = (v.numpy() for v in (w[0]["w"], w[0]["b"], w[1]["w"], w[1]["b"]))
    x = RNG.normal(size=(B, D))
    # NumPy reference of the forward with micro-batch statistics.
    h1 = x @ w1 + b1
    h2 = np.concatenate([np.tanh(bn_np(h1[i * B // M:(i + 1) * B // M])[0] @ w2 + b2) for i in range(M)])
    learner = Learner(task, training_params().set(learning_rate=0.0))
    learner.train_step({"inputs": tf.constant(x), "labels": tf.constant(RNG.integers(0, 3, size=B), tf.int32)})
    bn1, bn3 = task.network.children["layer_1"].vars, task.network.children["layer_3"].vars
    # decay 0.5 from (0, 1): a second update (e.g. from recomputation) would move them further.
    np.testing.assert_allclose(bn1["moving_mean"].numpy(), 0.5 * h1.mean(0), rtol=1e-10)
    np.testing.assert_allclose(bn1["moving_variance"].numpy(), 0.5 + 0.5 * h1.var(0), rtol=1e-10)
    np.testing.assert_allclose(bn3["moving_mean"].numpy(), 0.5 * h2.mean(0), rtol=1e-10)
    np.testing.assert_allclose(bn3["moving_variance"].numpy(), 0.5 + 0.5 * h2.var(0), rtol=1e-10)


def test_training_mode_gradients_equal_micro_batches_fed_one_by_one():
    x = tf.constant(RNG.normal(size=(B, D)))
    pipe = GPipe.params().set(name="net", dtype="float64", layers=layers(), num_stages=2, num_micro_batches=M,
                              remat="always", devices=["/device:CPU:0", "/device:CPU:1"]).instantiate()
    seq = Sequential.params().set(name="net", dtype="float64", layers=layers()).instantiate()
    ctx = FPropContext(training=True)

    @tf.function(autograph=False)
    def pipelined():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(pipe.fprop(pipe.theta, x, ctx)))
        with placement.colocate_gradients():
            return loss, tape.gradient(loss, pipe.trainable_variables)

    @tf.function(autograph=False)
    def one_by_one():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.square(seq.fprop(seq.theta, x[i * B // M:(i + 1) * B // M], ctx)))
                             for i in range(M)])
        return loss, tape.gradient(loss, seq.trainable_variables)

    (lp, gp), (ls, gs) = pipelined(), one_by_one()
    np.testing.assert_allclose(lp.numpy(), ls.numpy(), rtol=1e-10)
    for a, b in zip(gp, gs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)


def test_two_replicas_of_two_micro_batches_equal_one_pipeline_of_four(monkeypatch):
    """D=2 replicas x M=2 see the same micro-batches as D=1 x M=4: same loss, weights and moving averages
    (the replicas' batch statistics are summed across replicas before the once-per-step update)."""
    from gpipe_tf.training.replicas import ReplicaLayout, replica_home_devices

    x = tf.constant(RNG.normal(size=(B, D)))
    labels = tf.constant(RNG.integers(0, 3, size=B), tf.int32)
    results, counts = [], []
    original = BatchNorm.apply_aux_stats
    seen = tf.Variable(0.0, dtype=tf.float64)

    def recording(self, aux):
        seen.assign_add(tf.cast(aux[self.path][2], tf.float64))  # the example count the update divides by
        return original(self, aux)

    monkeypatch.setattr(BatchNorm, "apply_aux_stats", recording)
    for num_replicas, m in ((1, 4), (2, 2)):
        network = GPipe.params().set(layers=layers(), num_stages=2, num_micro_batches=m)
        with placement.replicas(num_replicas):
            task = make_task(network)
        layout = ReplicaLayout(local_replicas=num_replicas)
        layout.attach_devices(replica_home_devices(task, num_replicas))
        learner = Learner(task, training_params().set(learning_rate=0.1), layout)
        seen.assign(0.0)
        loss = learner.train_step({"inputs": x, "labels": labels})["loss"].numpy()
        counts.append(float(seen.numpy()))
        results.append((loss, [v.numpy() for v in task.variables]))
    # Summed over replicas, not averaged: every update sees the whole batch's B examples.
    assert counts == [2 * B, 2 * B]  # two batch-norm layers, each updated from all B examples
    (loss1, vars1), (loss2, vars2) = results
    np.testing.assert_allclose(loss2, loss1, rtol=1e-10)
    assert len(vars1) == len(vars2)
    for a, b in zip(vars2, vars1):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_float64_moving_averages_use_the_exact_decay():
    # 0.9 has no exact float32 form: a decay that passed through float32 is off by ~2e-8, far above 1e-12.
    decay = 0.9
    layer = BatchNorm.params().set(dim=D, dtype="float64", decay=decay).instantiate()
    x = RNG.normal(size=(B, D)) * 3 + 2
    mean0, var0 = RNG.normal(size=D), RNG.uniform(1, 2, size=D)
    layer.vars["moving_mean"].assign(mean0)
    layer.vars["moving_variance"].assign(var0)
    aux = {}
    layer.fprop(layer.theta, tf.constant(x), FPropContext(training=True, aux=aux))
    layer.apply_aux_stats(aux)
    np.testing.assert_allclose(layer.vars["moving_mean"].numpy(), decay * mean0 + (1 - decay) * x.mean(0),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(layer.vars["moving_variance"].numpy(), decay * var0 + (1 - decay) * x.var(0),
                               rtol=0, atol=1e-12)
