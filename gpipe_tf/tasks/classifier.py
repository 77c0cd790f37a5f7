"""Classification task: a network body, a softmax layer, cross-entropy loss and accuracy."""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.softmax import SoftmaxCrossEntropy
from gpipe_tf.tasks.base_task import BaseTask, Metrics


class ClassifierTask(BaseTask):
    """Classifies batch['inputs'] into batch['labels'] with `network` then `softmax`."""

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
        """Mean smoothed cross-entropy; metrics: loss, accuracy (weighted by the batch size)."""
        features = self.network.fprop(theta["network"], batch["inputs"], ctx)
        logits = self.softmax.fprop(theta["softmax"], features, ctx)
        xent = self.softmax.xent(logits, batch["labels"])
        loss = tf.reduce_mean(xent)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), batch["labels"]), loss.dtype)
        weight = tf.cast(tf.size(xent), loss.dtype)
        return loss, {"loss": (loss, weight), "accuracy": (tf.reduce_mean(correct), weight)}
