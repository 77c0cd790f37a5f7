"""Classification task: a network body, a softmax layer, cross-entropy loss and accuracy."""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.softmax import SoftmaxCrossEntropy
from gpipe_tf.tasks.base_task import BaseTask, Metrics


class ClassifierTask(BaseTask):
    """Classifies batch['inputs'] into batch['labels'] with `network` then `softmax`.

    Labels are int32 of any shape the logits have without their class dimension: [B] for one class per
    example, [B, T] for one per position (a language model's next tokens). An optional batch['weights'] of the
    labels' shape weights each label's cross-entropy and accuracy; 0.0 ignores it (padding). Without it, every
    label weighs 1.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: network and softmax layer Params."""
        p = super().params()
        p.define("network", None, "Layer Params of the body: inputs -> features of size softmax.input_dim.")
        p.define("softmax", SoftmaxCrossEntropy.params(), "Softmax layer Params (num_classes, label_smoothing).")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        if self.p.network is None:
            raise ParamsError(f"{self.path}.network is None; set it to a layer's Params (e.g. Sequential)")
        self.network = self.create_child("network", self.p.network)
        self.softmax = self.create_child("softmax", self.p.softmax)

    def compute_loss(self, theta: Mapping[str, Any], batch: Mapping[str, tf.Tensor],
                     ctx: FPropContext) -> tuple[tf.Tensor, Metrics]:
        """Smoothed cross-entropy averaged over the labels (weighted by batch['weights'] if given); metrics:
        loss and accuracy, each weighted by the number of labels (or the sum of their weights)."""
        features = self.network.fprop(theta["network"], self.to_fprop_dtype(batch["inputs"]), ctx)
        logits = self.softmax.fprop(theta["softmax"], features, ctx)
        xent = self.softmax.xent(logits, batch["labels"])
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), batch["labels"]), xent.dtype)
        if "weights" not in batch:
            loss = tf.reduce_mean(xent)
            weight = tf.cast(tf.size(xent), loss.dtype)
            return loss, {"loss": (loss, weight), "accuracy": (tf.reduce_mean(correct), weight)}
        weights = tf.ensure_shape(tf.cast(batch["weights"], xent.dtype), xent.shape)
        weight = tf.reduce_sum(weights)
        # divide_no_nan: a batch of padding only (weight 0) gives loss 0 and zero gradients, not NaN.
        loss = tf.math.divide_no_nan(tf.reduce_sum(xent * weights), weight)
        accuracy = tf.math.divide_no_nan(tf.reduce_sum(correct * weights), weight)
        return loss, {"loss": (loss, weight), "accuracy": (accuracy, weight)}
