"""Softmax output layer: logits from a projection, cross-entropy with label smoothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements, sensitive_dtype


def smoothed_xent(logits: tf.Tensor, labels: tf.Tensor, label_smoothing: float) -> tf.Tensor:
    """Per-example cross-entropy against one-hot targets smoothed as (1 - eps) * onehot + eps / num_classes.

    logits: [..., num_classes]; labels: int [...] (one outside [0, num_classes) has all-zero one-hot targets).
    Half-precision logits are cast to float32 first: the loss is computed in float32. TensorFlow's fused
    cross-entropy ops keep one logits-sized
    tensor (softmax - targets) for the gradient, where a log-softmax times one-hot targets keeps the targets and the
    log-softmax: the sparse op without smoothing (no targets are made), the dense op on targets made by one
    `one_hot` with smoothing. Measured on whole pipelined steps without smoothing (docs/memory.md), the last device
    of a vocabulary-2048 Transformer stack held 0.7-6.6 MiB less; on one CPU thread the fused ops' own time is 1.1x
    (sparse) to 1.3-1.6x (dense) the unfused form's, small beside the logits' projection.
    """
    logits = tf.cast(logits, sensitive_dtype(logits.dtype))
    if not label_smoothing:
        # A label outside [0, num_classes) (e.g. -1 for "ignore") has all-zero targets: loss and gradient 0, as
        # one-hot targets give, where the sparse op would fail (CPU) or give NaN (GPU).
        labels = tf.cast(labels, tf.int32)
        valid = (labels >= 0) & (labels < tf.shape(logits)[-1])
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.where(valid, labels, 0), logits=logits)
        return tf.where(valid, xent, tf.zeros_like(xent))
    num_classes = tf.shape(logits)[-1]
    off = label_smoothing / tf.cast(num_classes, logits.dtype)
    targets = tf.one_hot(labels, num_classes, on_value=1.0 - label_smoothing + off, off_value=off,
                         dtype=logits.dtype)
    return tf.nn.softmax_cross_entropy_with_logits(labels=targets, logits=logits)


class SoftmaxCrossEntropy(BaseLayer):
    """Projects inputs to `num_classes` logits; `xent` gives per-example smoothed cross-entropy.

    The projection runs in the compute dtype; the bias is added in the variables' dtype and the logits leave in it
    (float32 under mixed precision), so the loss, the metrics, decoding's log-probabilities and the bias gradient
    (a sum over every example) are computed in float32.
    """

    UNCAST_VARIABLES = frozenset({"b"})

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, num_classes, has_bias, label_smoothing."""
        p = super().params()
        p.define("input_dim", 0, "Size of the last input dimension.")
        p.define("num_classes", 0, "Number of output classes.")
        p.define("has_bias", True, "Whether the logits projection has a bias.")
        p.define("label_smoothing", 0.0, "Probability mass spread uniformly over all classes, in [0, 1).")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.input_dim <= 0 or p.num_classes <= 1:
            raise ParamsError(f"{self.path}: need input_dim > 0 and num_classes > 1, got {p.input_dim} and "
                              f"{p.num_classes}")
        if not 0.0 <= p.label_smoothing < 1.0:
            raise ParamsError(f"{self.path}.label_smoothing={p.label_smoothing} must be in [0, 1)")
        self.create_variable("w", [p.input_dim, p.num_classes])
        if p.has_bias:
            self.create_variable("b", [p.num_classes], init=initializers.weight_init("constant", 0.0))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Returns logits of shape inputs.shape[:-1] + [num_classes], in the variables' dtype."""
        logits = tf.cast(tf.tensordot(inputs, theta["w"], axes=[[-1], [0]]), self.dtype)
        if self.p.has_bias:
            logits += tf.cast(theta["b"], self.dtype)
        return logits

    def xent(self, logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        """Per-example cross-entropy of `logits` against int `labels`, with this layer's label smoothing."""
        return smoothed_xent(logits, labels, self.p.label_smoothing)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """input_dim * num_classes (+ num_classes for the bias)."""
        return p.input_dim * p.num_classes + (p.num_classes if p.has_bias else 0)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Logits: leading dims, last dim num_classes, in the variables' dtype."""
        return tf.TensorSpec(input_spec.shape[:-1].concatenate([p.num_classes]), p.dtype or input_spec.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """The logits matmul."""
        return 2.0 * (num_elements(input_spec) // p.input_dim) * p.input_dim * p.num_classes

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The logits in the variables' dtype (the loss's softmax, outside this layer, keeps its own copy)."""
        return elements_bytes(cls.output_spec(p, input_spec))

    @classmethod
    def loss_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """What the projection and `xent` hold at once in a training step on `input_spec` features, at the start of
        their backward pass: logits-sized tensors in the loss's dtype (float32 under mixed precision): the logits,
        the gradient the fused cross-entropy computes with its loss and the logits' gradient made from it, and with
        label smoothing the smoothed targets (the sparse op takes the labels); and the projection's output in the
        compute dtype where that is another dtype."""
        logits = num_elements(input_spec) // p.input_dim * p.num_classes
        compute = tf.as_dtype(input_spec.dtype)
        loss = sensitive_dtype(tf.as_dtype(p.dtype or "float32"))
        kept = 3 + (1 if p.label_smoothing else 0)
        return logits * (kept * loss.size + (compute.size if compute != loss else 0))
