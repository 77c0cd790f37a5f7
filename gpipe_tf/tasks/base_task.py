"""Tasks: the layers of a model plus its loss and metrics, computed from one batch."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.schedule_base import PipelineLoss
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext

# A metric is (value, weight): evaluation averages values weighted by their weights across batches.
Metrics = dict[str, tuple[tf.Tensor, tf.Tensor]]
# head(head_theta, network_outputs, targets, ctx) -> {name: sum over the examples}, with a "loss" entry.
Head = Callable[[Any, Any, Any, FPropContext], dict]


class BaseTask(BaseLayer):
    """Base class of tasks. Subclasses build their layers in `__init__` and implement `compute_loss`.

    A task whose `network` is pipelined runs its loss head (`network_and_head`) on the device of the pipeline's
    last chunk; it creates the head's layers with `create_head`, so that their variables, gradient sums and
    optimizer slots live there too, and says which they are in `head_params` (the memory planner reads it).
    """

    @classmethod
    def head_params(cls, p: InstantiableParams) -> list[tuple[str, InstantiableParams]]:
        """(child name, layer Params) of the layers this task runs on its network's output, from Params alone: by
        default every field of `p` that holds a layer's Params, except `network`. A task that builds its head
        from other fields overrides it."""
        return [(name, value) for name, value in p.items() if name != "network"
                and isinstance(value, InstantiableParams) and isinstance(value.cls, type)
                and issubclass(value.cls, BaseLayer)]

    def create_head(self, name: str, params: InstantiableParams, network: BaseLayer) -> BaseLayer:
        """Creates child `name`, a layer of the loss head on `network`'s output: under a pipelined network, with
        its variables on the device of the network's last chunk, which runs the head."""
        where = tf.device(network.devices[-1]) if isinstance(network, GPipe) else contextlib.nullcontext()
        with where:
            return self.create_child(name, params)

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
        if loss_scale is not None:
            ctx = dataclasses.replace(ctx, loss_scale=loss_scale)  # the same aux dict: a shallow copy
        with tf.GradientTape() as tape:
            loss, metrics = self.compute_loss(self.fprop_theta, batch, ctx)
            scaled = loss if loss_scale is None else loss * tf.cast(loss_scale, loss.dtype)
        # Pipelined layers need each stage's backward on its own device; harmless without a pipeline.
        with placement.colocate_gradients():
            grads = tape.gradient(scaled, variables)
        if loss_scale is not None:
            grads = [_unscale(g, loss_scale) for g in grads]
        return loss, metrics, grads

    def network_and_head(self, network: BaseLayer, network_theta: Any, inputs: Any, head: Head, head_theta: Any,
                         targets: Any, normalizer: tf.Tensor, ctx: FPropContext) -> dict[str, tf.Tensor]:
        """`head`'s sums over the batch of `network`'s outputs: the one way tasks compute their loss.

        `head` returns sums over the examples it is given ("loss" and metric numerators); the task divides them by
        `normalizer` (the full batch's summed label weights), so the result is the same whether the head sees the
        whole batch or one micro-batch at a time. A `GPipe` network runs the head in its last stage
        (`GPipe.fprop_with_loss`): per micro-batch (every schedule but Unrolled), the backward starting from
        loss_scale / normalizer. Any other network runs, then the head on its whole output.
        """
        if not isinstance(network, GPipe):
            return head(head_theta, network.fprop(network_theta, inputs, ctx), targets, ctx)
        flat_head = tf.nest.flatten(head_theta)

        def fn(weights: Any, outputs: Any, micro_targets: Any, micro_ctx: FPropContext) -> dict:
            return head(tf.nest.pack_sequence_as(head_theta, list(weights)), outputs, micro_targets, micro_ctx)

        scale = tf.constant(1.0) if ctx.loss_scale is None else tf.cast(ctx.loss_scale, tf.float32)
        # divide_no_nan: a batch of padding only (normalizer 0) seeds zeros, as its loss has zero gradients.
        seed = tf.math.divide_no_nan(scale, tf.cast(normalizer, tf.float32))
        return network.fprop_with_loss(network_theta, inputs, PipelineLoss(fn, tuple(flat_head), targets, seed), ctx)

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
