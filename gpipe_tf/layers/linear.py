"""Linear projection: y = activation(x W + b) over the last dimension."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers, weight_gradients
from gpipe_tf.layers.activations import KEPT_COPIES, activation_fn
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements


class Linear(BaseLayer):
    """A fully connected projection of the last dimension, with optional bias and activation."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, output_dim, has_bias, activation."""
        p = super().params()
        p.define("input_dim", 0, "Size of the last input dimension.")
        p.define("output_dim", 0, "Size of the last output dimension.")
        p.define("has_bias", True, "Whether to add a bias vector.")
        p.define("activation", "none", "Activation applied after the projection (see activations.py).")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.input_dim <= 0 or p.output_dim <= 0:
            raise ParamsError(f"{self.path}: input_dim and output_dim must be > 0, got {p.input_dim} and "
                              f"{p.output_dim}; set them in the layer's Params")
        self._act = activation_fn(p.activation)
        self.create_variable("w", [p.input_dim, p.output_dim])
        if p.has_bias:
            self.create_variable("b", [p.output_dim], init=initializers.weight_init("constant", 0.0))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Projects the last dimension of `inputs` from input_dim to output_dim."""
        out = weight_gradients.matmul(inputs, theta["w"])  # its weight gradient may be batched (B/W split)
        if self.p.has_bias:
            out += theta["b"]
        return self._act(out)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """input_dim * output_dim (+ output_dim for the bias)."""
        return p.input_dim * p.output_dim + (p.output_dim if p.has_bias else 0)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Same leading dims, last dim output_dim."""
        return tf.TensorSpec(input_spec.shape[:-1].concatenate([p.output_dim]), input_spec.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """2 * rows * input_dim * output_dim (multiply-adds of the matmul)."""
        rows = num_elements(input_spec) // p.input_dim
        return 2.0 * rows * p.input_dim * p.output_dim

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The output, and what the activation keeps besides it (the matmul's gradient reads the input and the
        weights, the bias add's nothing): one output-sized tensor for 'none', relu or tanh."""
        return max(KEPT_COPIES[p.activation], 1) * elements_bytes(cls.output_spec(p, input_spec))
