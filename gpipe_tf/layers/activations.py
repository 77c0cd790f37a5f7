"""Activation functions by name, and an Activation layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements

_ACTIVATIONS: dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    "none": tf.identity,
    "relu": tf.nn.relu,
    "relu6": tf.nn.relu6,
    "gelu": lambda x: tf.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: tf.nn.gelu(x, approximate=True),
    "tanh": tf.tanh,
    "sigmoid": tf.sigmoid,
    "swish": tf.nn.silu,
    "softplus": tf.nn.softplus,
}

# Tensors of the activation's size that applying it keeps for the backward pass, its output included: ReLU, tanh
# and sigmoid gradients read their output; relu6, swish and softplus read their input too; exact GELU,
# 0.5 x (1 + erf(x / sqrt 2)), keeps x, x / sqrt 2, 1 + erf, 0.5 x and the product; the tanh form two more.
KEPT_COPIES: dict[str, int] = {"none": 0, "relu": 1, "relu6": 2, "gelu": 5, "gelu_tanh": 7, "tanh": 1,
                               "sigmoid": 1, "swish": 2, "softplus": 2}
READS_INPUT = frozenset({"relu6", "gelu", "gelu_tanh", "swish", "softplus"})


def activation_fn(name: str) -> Callable[[tf.Tensor], tf.Tensor]:
    """Returns the activation function called `name`; an unknown name lists the known ones."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ParamsError(f"unknown activation {name!r}; expected one of {', '.join(_ACTIVATIONS)}") from None


class Activation(BaseLayer):
    """Applies a named elementwise activation; has no weights."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `activation` name."""
        p = super().params()
        p.define("activation", "relu", f"One of {', '.join(_ACTIVATIONS)}.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self._fn = activation_fn(self.p.activation)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Returns activation(inputs)."""
        return self._fn(inputs)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """No weights."""
        return 0

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """One op per element."""
        return 1.0 * num_elements(input_spec)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Unchanged shape and dtype."""
        return input_spec

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """`KEPT_COPIES[activation]` tensors of the input's size (the input itself is its producer's)."""
        return (KEPT_COPIES[p.activation] - (p.activation in READS_INPUT)) * elements_bytes(input_spec)
