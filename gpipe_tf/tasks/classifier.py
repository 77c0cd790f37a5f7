"""Classification task: a network body, a softmax layer, cross-entropy loss and accuracy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
        self.softmax = self.create_head("softmax", self.p.softmax, self.network)

    def compute_loss(self, theta: Mapping[str, Any], batch: Mapping[str, tf.Tensor],
                     ctx: FPropContext) -> tuple[tf.Tensor, Metrics]:
        """Smoothed cross-entropy averaged over the labels (weighted by batch['weights'] if given); metrics:
        loss and accuracy, each weighted by the number of labels (or the sum of their weights).

        The softmax and the sums run where `network_and_head` puts them: in a pipeline's last stage, per
        micro-batch if its schedule needs that."""
        labels = batch["labels"]
        targets = {"labels": labels}
        if "weights" in batch:
            targets["weights"] = batch["weights"]
            weight = tf.reduce_sum(tf.cast(batch["weights"], tf.float32))
        else:
            weight = tf.cast(tf.size(labels), tf.float32)
        sums = self.network_and_head(self.network, theta["network"], self.to_fprop_dtype(batch["inputs"]),
                                     self._head, theta["softmax"], targets, weight, ctx)
        weight = tf.cast(weight, sums["loss"].dtype)
        # divide_no_nan: a batch of padding only (weight 0) gives loss 0 and zero gradients, not NaN.
        loss = tf.math.divide_no_nan(sums["loss"], weight)
        accuracy = tf.math.divide_no_nan(sums["accuracy"], weight)
        return loss, {"loss": (loss, weight), "accuracy": (accuracy, weight)}

    def _head(self, theta: Mapping[str, Any], features: tf.Tensor, targets: Mapping[str, tf.Tensor],
              ctx: FPropContext) -> dict[str, tf.Tensor]:
        """Summed (weighted) cross-entropy and correct predictions of `features`' logits."""
        logits = self.softmax.fprop(theta, features, ctx)
        xent = self.softmax.xent(logits, targets["labels"])
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), targets["labels"]), xent.dtype)
        if "weights" not in targets:
            return {"loss": tf.reduce_sum(xent), "accuracy": tf.reduce_sum(correct)}
        weights = tf.ensure_shape(tf.cast(targets["weights"], xent.dtype), xent.shape)
        return {"loss": tf.reduce_sum(xent * weights), "accuracy": tf.reduce_sum(correct * weights)}
