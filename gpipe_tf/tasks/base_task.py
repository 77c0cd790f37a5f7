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

    def loss_and_gradients(self, batch: Mapping[str, tf.Tensor], ctx: FPropContext,
                           loss_scale: tf.Tensor | None = None) -> tuple[tf.Tensor, Metrics, list[tf.Tensor]]:
        """Loss, metrics and gradients of the loss for each of `self.trainable_variables`.

        The model runs on `fprop_theta` (its weights cast for mixed precision). With `loss_scale` (a float32
        scalar), the backward pass differentiates loss * loss_scale, so that small half-precision gradients do not
        underflow, and the gradients are divided by it again in the variables' dtype (float32): they are the
        loss's own gradients, non-finite where the scaled backward overflowed. The default takes one tape over
        the whole model; pipelined layers run their own schedules inside it.
        """
        variables = self.trainable_variables
        with tf.GradientTape() as tape:
            loss, metrics = self.compute_loss(self.fprop_theta, batch, ctx)
            scaled = loss if loss_scale is None else loss * tf.cast(loss_scale, loss.dtype)
        # Pipelined layers need each stage's backward on its own device; harmless without a pipeline.
        with placement.colocate_gradients():
            grads = tape.gradient(scaled, variables)
        if loss_scale is not None:
            grads = [_unscale(g, loss_scale) for g in grads]
        return loss, metrics, grads

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """Tasks are run through `compute_loss`; `fprop` is the same computation, returning (loss, metrics)."""
        return self.compute_loss(theta, inputs, ctx)


def _unscale(grad: Any, loss_scale: tf.Tensor) -> Any:
    """`grad` divided by `loss_scale` in its own dtype; None stays None, IndexedSlices (gathers) stay sparse."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(loss_scale, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad / tf.cast(loss_scale, grad.dtype)
