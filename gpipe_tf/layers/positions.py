"""Sinusoidal position encodings and a token embedding that adds them.

Encoding of position `pos` with `dim` channels and `half = dim // 2` timescales
`timescale_i = min_timescale * (max_timescale / min_timescale) ** (i / (half - 1))`, i = 0 .. half-1:
channels [0, half) hold sin(pos / timescale_i) and channels [half, 2 * half) hold cos(pos / timescale_i); an odd
`dim` leaves its last channel 0. The layout (sines then cosines, not interleaved) is a convention: any fixed
layout works, as long as training and decoding use the same one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers import initializers
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, fprop_dtype_of, num_elements
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.embedding import Embedding


def sinusoidal_encoding(positions: tf.Tensor, dim: int, dtype: tf.DType | str = tf.float32,
                        min_timescale: float = 1.0, max_timescale: float = 1.0e4) -> tf.Tensor:
    """Encodings of int or float `positions` of any shape: returns positions.shape + [dim] in `dtype`.

    Computed in float64 and then cast: in float32, `pos / timescale` for positions in the thousands already
    loses enough digits to shift sin/cos in the third decimal.
    """
    if dim <= 0:
        raise ValueError(f"dim must be > 0, got {dim}")
    half = dim // 2
    positions = tf.cast(positions, tf.float64)
    if half == 0:
        return tf.zeros(tf.concat([tf.shape(positions), [dim]], 0), dtype)
    log_increment = math.log(max_timescale / min_timescale) / max(half - 1, 1)
    inv_timescales = (1.0 / min_timescale) * tf.exp(tf.range(half, dtype=tf.float64) * -log_increment)
    scaled = positions[..., tf.newaxis] * inv_timescales
    signal = tf.concat([tf.sin(scaled), tf.cos(scaled)], axis=-1)
    if dim % 2:
        signal = tf.concat([signal, tf.zeros_like(signal[..., :1])], axis=-1)
    return tf.cast(signal, dtype)


def sinusoidal_positions(length: int | tf.Tensor, dim: int, dtype: tf.DType | str = tf.float32) -> tf.Tensor:
    """The encodings of positions 0 .. length-1: a [length, dim] tensor in `dtype` (see the module doc)."""
    return sinusoidal_encoding(tf.range(length), dim, dtype)


class TokenEmbeddingWithPositions(BaseLayer):
    """Token embedding plus sinusoidal position encoding, then dropout: int ids [B, T] -> [B, T, embedding_dim].

    out = dropout(emb[ids] * (sqrt(embedding_dim) if scale_sqrt_depth else 1) + positions). `fprop` numbers the
    positions 0 .. T-1; `fprop_with_positions` takes explicit positions, e.g. the current step when decoding one
    token at a time, so that incremental decoding sees the same encodings as a full forward pass.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: vocab_size, embedding_dim, scale_sqrt_depth, dropout_rate, max_timescale."""
        p = super().params()
        p.define("vocab_size", 0, "Number of token ids (0 .. vocab_size-1).")
        p.define("embedding_dim", 0, "Size of each embedding vector, and of the position encodings.")
        p.define("scale_sqrt_depth", True, "Multiply looked-up vectors by sqrt(embedding_dim) (Transformer). The "
                 "table's initializer scale is then divided by sqrt(embedding_dim), so the scaled vectors start at "
                 "the initializer's scale (unit variance by default), comparable to the position encodings.")
        p.define("dropout_rate", 0.0, "Dropout on the sum of embeddings and position encodings.")
        p.define("max_timescale", 1.0e4, "Longest timescale of the sinusoids.")
        p.params_init = initializers.weight_init("gaussian", 1.0)
        return p

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        # One definition serves __init__, num_params and flops, so counts cannot drift from what is built.
        if p.vocab_size <= 0 or p.embedding_dim <= 0:
            raise ParamsError(f"{p.name or 'token_embedding_with_positions'}: vocab_size and embedding_dim must be "
                              f"> 0, got {p.vocab_size} and {p.embedding_dim}")
        init = p.params_init.copy()
        if p.scale_sqrt_depth:
            init.scale = float(init.scale) / math.sqrt(p.embedding_dim)
        return {
            "token_emb": Embedding.params().set(vocab_size=p.vocab_size, embedding_dim=p.embedding_dim,
                                                scale_sqrt_depth=p.scale_sqrt_depth, params_init=init),
            "dropout": Dropout.params().set(rate=p.dropout_rate),
        }

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    def embed_without_dropout(self, theta: Mapping[str, Any], ids: tf.Tensor, positions: tf.Tensor,
                              ctx: FPropContext) -> tf.Tensor:
        """emb[ids] (scaled) + positions, before dropout: for a caller that draws its own mask on a second input.

        `ids` are int of any shape, `positions` int broadcastable to ids' shape; returns ids.shape + [dim].
        """
        emb = self.children["token_emb"].fprop(theta["token_emb"], ids, ctx)
        pos = sinusoidal_encoding(positions, self.p.embedding_dim, emb.dtype, max_timescale=self.p.max_timescale)
        return emb + pos

    def fprop_with_positions(self, theta: Mapping[str, Any], ids: tf.Tensor, positions: tf.Tensor,
                             ctx: FPropContext) -> tf.Tensor:
        """Embeds `ids` (int, any shape) at `positions` (int, broadcastable to ids' shape): ids.shape + [dim]."""
        x = self.embed_without_dropout(theta, ids, positions, ctx)
        return self.children["dropout"].fprop(theta["dropout"], x, ctx)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Embeds ids [B, T] at positions 0 .. T-1: returns [B, T, embedding_dim]."""
        inputs = tf.convert_to_tensor(inputs)
        if inputs.shape.rank is not None and inputs.shape.rank != 2:
            raise ValueError(f"{self.path}: ids must have shape [batch, time], got {inputs.shape}")
        return self.fprop_with_positions(theta, inputs, tf.range(tf.shape(inputs)[1])[tf.newaxis, :], ctx)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """vocab_size * embedding_dim (the position encodings have no weights)."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Ids shape plus embedding_dim, in the layer's compute dtype."""
        return tf.TensorSpec(input_spec.shape.concatenate([p.embedding_dim]), fprop_dtype_of(p))

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """The gather, the sqrt-depth scale if any, the position add, and dropout: per output element.

        Computing the [T, dim] encoding table (one sin or cos per entry) is left out: it is T/B of one add.
        """
        children = cls._child_params(p)
        out_spec = cls.output_spec(p, input_spec)
        n = num_elements(out_spec)
        scale = n if p.scale_sqrt_depth else 0
        return (Embedding.flops(children["token_emb"], input_spec) + scale + n
                + Dropout.flops(children["dropout"], out_spec))

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The sum of the embeddings and the position encodings (an add's gradient reads neither operand, so the
        embedding's output goes), and the dropout's."""
        children = cls._child_params(p)
        out_spec = cls.output_spec(p, input_spec)
        return elements_bytes(out_spec) + Dropout.activation_bytes(children["dropout"], out_spec)
