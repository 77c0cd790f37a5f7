"""The classification head: the last cell's pair -> ReLU -> global average pool -> dropout -> logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.linear import Linear


class ClassifierHead(BaseLayer):
    """Takes (h[i], h[i-1]), uses h[i]: ReLU -> mean over height and width -> dropout -> linear with bias.

    num_classes 0 stops after the dropout and returns the pooled features (input_dim wide), for tasks that
    bring their own softmax layer.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, num_classes, dropout_rate."""
        p = super().params()
        p.define("input_dim", 0, "Channels of the last cell's output.")
        p.define("num_classes", 1001, "Logits per example (1001 in [TPU]); 0: return the pooled features.")
        p.define("dropout_rate", 0.5, "Dropout rate before the linear layer ([TPU]: keep probability 0.5).")
        return p

    @classmethod
    def _children(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        if p.input_dim <= 0 or p.num_classes < 0:
            raise ParamsError(f"ClassifierHead: input_dim must be > 0 and num_classes >= 0, got {p.input_dim} and "
                              f"{p.num_classes}")
        children = {"dropout": Dropout.params().set(rate=p.dropout_rate)}
        if p.num_classes:
            children["logits"] = Linear.params().set(input_dim=p.input_dim, output_dim=p.num_classes)
        return children

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child in self._children(self.p).items():
            self.create_child(name, child)

    def fprop(self, theta: Mapping[str, Any], inputs: tuple[tf.Tensor, tf.Tensor], ctx: FPropContext) -> tf.Tensor:
        """(h[i], h[i-1]) -> [batch, num_classes] logits (or [batch, input_dim] features)."""
        x = tf.reduce_mean(tf.nn.relu(inputs[0]), axis=[1, 2])
        for name, child in self.children.items():
            x = child.fprop(theta[name], x, ctx)
        return x

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The linear layer's weights and bias."""
        return sum(cp.cls.num_params(cp) for cp in cls._children(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]) -> tf.TensorSpec:
        """[batch, num_classes] (or [batch, input_dim])."""
        spec = input_spec[0]
        if spec.shape.rank != 4 or spec.shape[-1] != p.input_dim:
            raise ParamsError(f"ClassifierHead expects NHWC with {p.input_dim} channels, got shape {spec.shape}")
        return tf.TensorSpec([spec.shape[0], p.num_classes or p.input_dim], spec.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]) -> float:
        """ReLU and pooling per input element, then dropout and the linear layer."""
        pooled = tf.TensorSpec([input_spec[0].shape[0], p.input_dim], input_spec[0].dtype)
        total = 2.0 * num_elements(input_spec[0])
        for cp in cls._children(p).values():
            total += cp.cls.flops(cp, pooled)
        return total

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]) -> int:
        """The ReLU's output over h[i] (its gradient reads it), the pooled features, the dropout's and the logits."""
        pooled = tf.TensorSpec([input_spec[0].shape[0], p.input_dim], input_spec[0].dtype)
        total = elements_bytes(input_spec[0]) + elements_bytes(pooled)
        for cp in cls._children(p).values():
            total += cp.cls.activation_bytes(cp, pooled)
            pooled = cp.cls.output_spec(cp, pooled)
        return total
