"""ClassifierTask: per-example and per-position labels, and label weights that ignore padding (NumPy reference)."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.sequential import Sequential
from gpipe_tf.tasks.classifier import ClassifierTask

NUM_CLASSES = 5
DIM = 3


def make_task(label_smoothing=0.0):
    """A float64 task whose body is one linear layer and whose softmax has NUM_CLASSES classes."""
    network = Sequential.params().set(layers=[Linear.params().set(name="fc", input_dim=DIM, output_dim=DIM)])
    p = ClassifierTask.params().set(name="task", dtype="float64", network=network)
    p.softmax.set(input_dim=DIM, num_classes=NUM_CLASSES, label_smoothing=label_smoothing)
    return p.instantiate()


def reference(task, inputs, labels, weights, label_smoothing):
    """NumPy loss and accuracy: smoothed cross-entropy per label, averaged with `weights` (None: uniform)."""
    theta = tf.nest.map_structure(lambda v: v.numpy(), task.theta)
    fc, softmax = theta["network"]["layer_0"], theta["softmax"]
    logits = (inputs @ fc["w"] + fc["b"]) @ softmax["w"] + softmax["b"]
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    targets = np.eye(NUM_CLASSES)[labels] * (1 - label_smoothing) + label_smoothing / NUM_CLASSES
    xent = -(targets * log_probs).sum(-1)
    correct = (logits.argmax(-1) == labels).astype(np.float64)
    weights = np.ones_like(xent) if weights is None else weights
    return (xent * weights).sum() / weights.sum(), (correct * weights).sum() / weights.sum(), weights.sum()


@pytest.mark.parametrize("per_position,weighted,label_smoothing", [
    (False, False, 0.0), (False, True, 0.1), (True, False, 0.0), (True, True, 0.0), (True, True, 0.2)])
def test_loss_and_accuracy_match_numpy(per_position, weighted, label_smoothing):
    rng = np.random.default_rng(0)
    shape = [4, 6] if per_position else [8]
    inputs = rng.normal(size=shape + [DIM])
    labels = rng.integers(0, NUM_CLASSES, size=shape).astype(np.int32)
    # Padding-like weights: each row's tail is 0 (per position), or some examples are ignored (per example).
    weights = None
    if weighted:
        weights = (np.arange(shape[-1]) < rng.integers(1, shape[-1] + 1, size=shape[:-1] + [1])).astype(np.float64)
        weights = weights * rng.choice([0.5, 1.0, 2.0], size=shape) if not per_position else weights
    task = make_task(label_smoothing)
    batch = {"inputs": tf.constant(inputs), "labels": tf.constant(labels)}
    if weights is not None:
        batch["weights"] = tf.constant(weights, tf.float32)  # any float dtype; cast to the task's
    loss, metrics = task.compute_loss(task.theta, batch, FPropContext(training=False))
    want_loss, want_accuracy, want_weight = reference(task, inputs, labels, weights, label_smoothing)
    np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-10)
    np.testing.assert_allclose(metrics["loss"][0].numpy(), want_loss, rtol=1e-10)
    np.testing.assert_allclose(metrics["accuracy"][0].numpy(), want_accuracy, rtol=1e-10)
    np.testing.assert_allclose(metrics["loss"][1].numpy(), want_weight)
    np.testing.assert_allclose(metrics["accuracy"][1].numpy(), want_weight)


def test_ignored_labels_get_no_gradient_and_all_padding_stays_finite():
    rng = np.random.default_rng(1)
    task = make_task()
    inputs = tf.constant(rng.normal(size=[2, 5, DIM]))
    labels = tf.constant(rng.integers(0, NUM_CLASSES, size=[2, 5]).astype(np.int32))
    weights = tf.constant([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], tf.float64)

    def gradients(batch):
        with tf.GradientTape() as tape:
            loss, _ = task.compute_loss(task.theta, batch, FPropContext(training=False))
        return loss, tape.gradient(loss, task.trainable_variables)

    # Changing the inputs and labels at weight-0 positions changes nothing (the body is position-wise).
    ignored = tf.equal(weights, 0.0)
    a = gradients({"inputs": inputs, "labels": labels, "weights": weights})
    b = gradients({"inputs": tf.where(ignored[..., tf.newaxis], inputs + 5.0, inputs),
                   "labels": tf.where(ignored, (labels + 1) % NUM_CLASSES, labels), "weights": weights})
    np.testing.assert_allclose(a[0].numpy(), b[0].numpy(), rtol=1e-12)
    for ga, gb in zip(a[1], b[1]):
        np.testing.assert_allclose(ga.numpy(), gb.numpy(), rtol=1e-12)
    loss, grads = gradients({"inputs": inputs, "labels": labels, "weights": tf.zeros_like(weights)})
    assert loss.numpy() == 0.0 and all(np.all(g.numpy() == 0.0) for g in grads)
