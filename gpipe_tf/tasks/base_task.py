"""Tasks: the layers of a model plus its loss and metrics, computed from one batch."""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext

# A metric is (value, weight): evaluation averages values weighted by their weights across batches.
Metrics = dict[str, tuple[tf.Tensor, tf.Tensor]]


class BaseTask(BaseLayer):
    """Base class of tasks. Subclasses build their layers in `__init__` and implement `compute_loss`."""

    def compute_loss(self, theta: Mapping[str, Any], batch: Mapping[str, tf.Tensor],
                     ctx: FPropContext) -> tuple[tf.Tensor, Metrics]:
        """Returns the scalar training loss and metrics for `batch`."""
        raise NotImplementedError(f"{type(self).__name__}.compute_loss")

    def loss_and_gradients(self, batch: Mapping[str, tf.Tensor],
                           ctx: FPropContext) -> tuple[tf.Tensor, Metrics, list[tf.Tensor]]:
        """Loss, metrics and gradients of the loss for each of `self.trainable_variables`.

        The default takes one tape over the whole model; a pipelined task overrides it with its own schedule
        (per-stage gradients accumulated over micro-batches) and must return the same numbers.
        """
        variables = self.trainable_variables
        with tf.GradientTape() as tape:
            loss, metrics = self.compute_loss(self.theta, batch, ctx)
        # Pipelined layers need each stage's backward on its own device; harmless without a pipeline.
        with placement.colocate_gradients():
            grads = tape.gradient(loss, variables)
        return loss, metrics, grads

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """Tasks are run through `compute_loss`; `fprop` is the same computation, returning (loss, metrics)."""
        return self.compute_loss(theta, inputs, ctx)
