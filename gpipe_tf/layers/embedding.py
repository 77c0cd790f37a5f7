"""Token embedding lookup."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, fprop_dtype_of, num_elements


class Embedding(BaseLayer):
    """Maps integer ids to vectors of size `embedding_dim`; optionally scales them by sqrt(embedding_dim).

    Under mixed precision the table stays in its dtype and only the gathered rows are cast: casting the whole
    table would copy every row in every step.
    """

    UNCAST_VARIABLES = frozenset({"emb"})

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: vocab_size, embedding_dim, scale_sqrt_depth."""
        p = super().params()
        p.define("vocab_size", 0, "Number of rows (ids 0..vocab_size-1).")
        p.define("embedding_dim", 0, "Size of each embedding vector.")
        p.define("scale_sqrt_depth", False, "Multiply looked-up vectors by sqrt(embedding_dim) (Transformer).")
        p.params_init = initializers.weight_init("gaussian", 1.0)
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        if self.p.vocab_size <= 0 or self.p.embedding_dim <= 0:
            raise ParamsError(f"{self.path}: vocab_size and embedding_dim must be > 0, got "
                              f"{self.p.vocab_size} and {self.p.embedding_dim}")
        self.create_variable("emb", [self.p.vocab_size, self.p.embedding_dim])

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Looks up `inputs` (int ids of any shape); returns shape inputs.shape + [embedding_dim]."""
        out = tf.cast(tf.gather(theta["emb"], inputs), self.fprop_dtype)
        if self.p.scale_sqrt_depth:
            out *= math.sqrt(self.p.embedding_dim)
        return out

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """vocab_size * embedding_dim."""
        return p.vocab_size * p.embedding_dim

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Ids shape plus embedding_dim, in the layer's compute dtype."""
        return tf.TensorSpec(input_spec.shape.concatenate([p.embedding_dim]), fprop_dtype_of(p))

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """A gather: one copy per output element."""
        return float(num_elements(input_spec) * p.embedding_dim)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The output only: the gather's gradient reads the ids, a cast's and a multiply by a constant's nothing of
        their input."""
        return elements_bytes(cls.output_spec(p, input_spec))
