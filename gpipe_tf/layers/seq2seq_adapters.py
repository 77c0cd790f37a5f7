"""Adapters that turn an encoder-decoder Transformer into ONE flat layer list for GPipe.

A pipeline splits every leaf of its input along the batch dimension and hands each stage's output to the next
stage, so the whole sequence-to-sequence model must pass one structure from layer to layer. The layers here keep
all of a micro-batch's tensors together:

    (src_ids [B, S] int32, src_paddings [B, S], tgt_ids [B, T] int32, tgt_paddings [B, T])
      SourceEmbedding  -> (x [B, S, D], src_paddings, tgt, tgt_paddings)
      EncoderBlock xN  -> the same structure, x replaced
      EncoderToDecoder -> (y [B, T, D], tgt_paddings, memory [B, S, D], src_paddings)
      TransformerDecoderLayer xM (its own 4-tuple contract)
      FinalNorm        -> decoder output [B, T, D]

Exactly one of the two embedding adapters embeds the target ids (its `embed_target` is True):

* SourceEmbedding (shared embedding, as in Lingvo's GPipe Transformer): the first stage looks up source and
  target ids in ONE table, and `tgt` is the embedded target [B, T, D], which the encoder stages carry along.
* EncoderToDecoder (separate tables): `tgt` stays the int ids [B, T] until EncoderToDecoder embeds them with its
  own table.

Paddings are floats, 1.0 = padding. Each adapter reports num_params, output_spec and flops from Params alone so
that `inspect` and flops-based balancing work without building the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.normalization import LayerNorm
from gpipe_tf.layers.positions import TokenEmbeddingWithPositions
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from gpipe_tf.layers.transformer_decoder import split_decoder_inputs


def _four(inputs: Any, what: str) -> tuple[Any, Any, Any, Any]:
    """Unpacks a 4-tuple (or 4-list), naming the layer in the error."""
    if not isinstance(inputs, (tuple, list)) or len(inputs) != 4:
        raise ValueError(f"{what} expects the 4-tuple (src_ids or x, src_paddings, tgt_ids or their embeddings, "
                         f"tgt_paddings), got {type(inputs).__name__}")
    return inputs[0], inputs[1], inputs[2], inputs[3]


def _embedding_params(p: InstantiableParams) -> InstantiableParams:
    if p.vocab_size <= 0 or p.model_dim <= 0:
        raise ParamsError(f"{p.name or 'embedding'}: vocab_size and model_dim must be > 0, got {p.vocab_size} "
                          f"and {p.model_dim}")
    return TokenEmbeddingWithPositions.params().set(
        vocab_size=p.vocab_size, embedding_dim=p.model_dim, dropout_rate=p.dropout_rate)


def _positions_of(ids: tf.Tensor) -> tf.Tensor:
    """Positions 0 .. T-1 of ids [B, T], as [1, T] (broadcast over the batch)."""
    return tf.range(tf.shape(ids)[1])[tf.newaxis, :]


class SourceEmbedding(BaseLayer):
    """(src_ids, src_paddings, tgt_ids, tgt_paddings) -> (x, src_paddings, tgt, tgt_paddings).

    Embeds the source ids with sinusoidal positions. With `embed_target`, the target ids are looked up in the same
    table (a shared source/target embedding) and `tgt` is their embedding [B, T, model_dim], with a dropout mask of
    its own; otherwise `tgt` is the ids, passed through to EncoderToDecoder.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: vocab_size, model_dim, dropout_rate, embed_target."""
        p = super().params()
        p.define("vocab_size", 0, "Number of token ids.")
        p.define("model_dim", 0, "Embedding size.")
        p.define("dropout_rate", 0.0, "Dropout on embeddings plus positions.")
        p.define("embed_target", False, "Also embed the target ids with this layer's table (shared source/target "
                 "embedding); the EncoderToDecoder after the encoder must then have embed_target=False.")
        return p

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        # The target gets its own Dropout (its own random_id): one Dropout drawing masks for both inputs from the
        # same stateless seed would give them the same random stream.
        children = {"emb": _embedding_params(p)}
        if p.embed_target:
            children["tgt_dropout"] = Dropout.params().set(rate=p.dropout_rate)
        return children

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    def embed_target(self, theta: Mapping[str, Any], ids: tf.Tensor, positions: tf.Tensor,
                     ctx: FPropContext) -> tf.Tensor:
        """Target ids at explicit positions, with the shared table: ids.shape + [model_dim].

        Used by `fprop` and by step-wise decoding; only for embed_target=True.
        """
        if not self.p.embed_target:
            raise ValueError(f"{self.path}: embed_target is False; the target table is EncoderToDecoder's")
        x = self.children["emb"].embed_without_dropout(theta["emb"], ids, positions, ctx)
        return self.children["tgt_dropout"].fprop(theta["tgt_dropout"], x, ctx)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tuple[Any, Any, Any, Any]:
        """Replaces src_ids by their embeddings [B, S, model_dim], and tgt_ids too with embed_target."""
        src_ids, src_paddings, tgt, tgt_paddings = _four(inputs, self.path)
        x = self.children["emb"].fprop(theta["emb"], src_ids, ctx)
        if self.p.embed_target:
            tgt = self.embed_target(theta, tgt, _positions_of(tgt), ctx)
        return x, src_paddings, tgt, tgt_paddings

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The embedding table: vocab_size * model_dim (one table, whether or not the target shares it)."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> tuple[Any, Any, Any, Any]:
        """src_ids' spec becomes the embeddings' spec, and tgt_ids' too with embed_target; the rest passes."""
        src, src_pad, tgt, tgt_pad = _four(input_spec, cls.__name__)
        ep = _embedding_params(p).set(dtype=p.dtype, fprop_dtype=p.fprop_dtype)
        if p.embed_target:
            tgt = ep.cls.output_spec(ep, tgt)
        return ep.cls.output_spec(ep, src), src_pad, tgt, tgt_pad

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """The embedding's flops on the source ids, plus on the target ids with embed_target."""
        src, _, tgt, _ = _four(input_spec, cls.__name__)
        ep = _embedding_params(p)
        return ep.cls.flops(ep, src) + (ep.cls.flops(ep, tgt) if p.embed_target else 0.0)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """The embedding's on the source ids, plus on the target ids with embed_target."""
        src, _, tgt, _ = _four(input_spec, cls.__name__)
        ep = _embedding_params(p).set(dtype=p.dtype, fprop_dtype=p.fprop_dtype)
        return ep.cls.activation_bytes(ep, src) + (ep.cls.activation_bytes(ep, tgt) if p.embed_target else 0)


class EncoderBlock(BaseLayer):
    """A TransformerEncoderLayer on the 4-tuple: x is updated under the source mask, the rest passes through."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: `layer`, the wrapped TransformerEncoderLayer's Params."""
        p = super().params()
        p.define("layer", TransformerEncoderLayer.params(), "Params of the wrapped encoder layer.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self.create_child("encoder", self.p.layer)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tuple[Any, Any, Any, Any]:
        """(x, src_paddings, tgt_ids, tgt_paddings) -> (new x, src_paddings, tgt_ids, tgt_paddings)."""
        x, src_paddings, tgt_ids, tgt_paddings = _four(inputs, self.path)
        x, _ = self.children["encoder"].fprop(theta["encoder"], (x, src_paddings), ctx)
        return x, src_paddings, tgt_ids, tgt_paddings

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The wrapped layer's count."""
        return p.layer.cls.num_params(p.layer)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> Any:
        """Unchanged."""
        _four(input_spec, cls.__name__)
        return input_spec

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """The wrapped layer's flops on (x, src_paddings)."""
        x, src_pad, _, _ = _four(input_spec, cls.__name__)
        return p.layer.cls.flops(p.layer, (x, src_pad))

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """The wrapped layer's on (x, src_paddings)."""
        x, src_pad, _, _ = _four(input_spec, cls.__name__)
        return p.layer.cls.activation_bytes(p.layer, (x, src_pad))


class EncoderToDecoder(BaseLayer):
    """(x, src_paddings, tgt, tgt_paddings) -> (y, tgt_paddings, memory, src_paddings).

    memory = LayerNorm(x), the pre-norm encoder stack's final norm. With `embed_target`, y embeds the target ids
    `tgt` with positions, in this layer's own table; without, `tgt` arrives embedded (by SourceEmbedding's shared
    table) and y = tgt. `encoder_memory` and `embed_target` expose the two halves for un-pipelined incremental
    decoding.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: vocab_size, model_dim, dropout_rate, ln_epsilon, embed_target."""
        p = super().params()
        p.define("vocab_size", 0, "Number of target token ids (unused without embed_target).")
        p.define("model_dim", 0, "Embedding and encoder output size.")
        p.define("dropout_rate", 0.0, "Dropout on the target embeddings plus positions (with embed_target).")
        p.define("ln_epsilon", 1e-6, "Epsilon of the encoder's final layer norm.")
        p.define("embed_target", True, "Embed the target ids here, with a table of this layer's own. False: the "
                 "target arrives embedded by the first layer (SourceEmbedding.embed_target, a shared table).")
        return p

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        children = {"encoder_ln": LayerNorm.params().set(dim=p.model_dim, epsilon=p.ln_epsilon)}
        if p.embed_target:
            children["tgt_emb"] = _embedding_params(p)
        return children

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    def encoder_memory(self, theta: Mapping[str, Any], x: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """The encoder output normalized: [B, S, model_dim]."""
        return self.children["encoder_ln"].fprop(theta["encoder_ln"], x, ctx)

    def embed_target(self, theta: Mapping[str, Any], ids: tf.Tensor, positions: tf.Tensor,
                     ctx: FPropContext) -> tf.Tensor:
        """Target ids at explicit positions (decoding one step at a time): ids.shape + [model_dim].

        Only for embed_target=True; otherwise SourceEmbedding.embed_target has the table.
        """
        if not self.p.embed_target:
            raise ValueError(f"{self.path}: embed_target is False; the target table is SourceEmbedding's")
        return self.children["tgt_emb"].fprop_with_positions(theta["tgt_emb"], ids, positions, ctx)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tuple[Any, Any, Any, Any]:
        """See the class doc."""
        x, src_paddings, tgt, tgt_paddings = _four(inputs, self.path)
        memory = self.encoder_memory(theta, x, ctx)
        y = self.embed_target(theta, tgt, _positions_of(tgt), ctx) if self.p.embed_target else tgt
        return y, tgt_paddings, memory, src_paddings

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The final encoder norm, plus the target embedding table with embed_target."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> tuple[Any, Any, Any, Any]:
        """(target embeddings, tgt_paddings, memory = x's spec, src_paddings)."""
        x, src_pad, tgt, tgt_pad = _four(input_spec, cls.__name__)
        if p.embed_target:
            ep = _embedding_params(p).set(dtype=p.dtype, fprop_dtype=p.fprop_dtype)
            tgt = ep.cls.output_spec(ep, tgt)
        return tgt, tgt_pad, x, src_pad

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Layer norm on x, plus the target embedding with embed_target."""
        x, _, tgt, _ = _four(input_spec, cls.__name__)
        children = cls._child_params(p)
        ln = children["encoder_ln"]
        flops = ln.cls.flops(ln, x)
        if p.embed_target:
            emb = children["tgt_emb"]
            flops += emb.cls.flops(emb, tgt)
        return flops

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Layer norm on x (the memory), plus the target embedding with embed_target."""
        x, _, tgt, _ = _four(input_spec, cls.__name__)
        children = cls._child_params(p)
        ln = children["encoder_ln"]
        total = ln.cls.activation_bytes(ln, x)
        if p.embed_target:
            emb = children["tgt_emb"].set(dtype=p.dtype, fprop_dtype=p.fprop_dtype)
            total += emb.cls.activation_bytes(emb, tgt)
        return total


class FinalNorm(BaseLayer):
    """(x, tgt_paddings, memory, src_paddings) -> LayerNorm(x) [B, T, model_dim]: the decoder stack's final norm."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: model_dim, ln_epsilon."""
        p = super().params()
        p.define("model_dim", 0, "Size of x's last dimension.")
        p.define("ln_epsilon", 1e-6, "Epsilon of the layer norm.")
        return p

    @classmethod
    def _ln_params(cls, p: InstantiableParams) -> InstantiableParams:
        return LayerNorm.params().set(dim=p.model_dim, epsilon=p.ln_epsilon)

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self.create_child("ln", self._ln_params(self.p))

    def normalize(self, theta: Mapping[str, Any], x: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """LayerNorm of a bare x (used by step-wise decoding)."""
        return self.children["ln"].fprop(theta["ln"], x, ctx)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tf.Tensor:
        """Normalizes the decoder output and drops the rest of the tuple."""
        x, _, _, _ = split_decoder_inputs(inputs)
        return self.normalize(theta, x, ctx)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """2 * model_dim."""
        lp = cls._ln_params(p)
        return lp.cls.num_params(lp)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> Any:
        """x's spec."""
        return split_decoder_inputs(input_spec)[0]

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """The layer norm on x."""
        lp = cls._ln_params(p)
        return lp.cls.flops(lp, split_decoder_inputs(input_spec)[0])

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """The layer norm's on x."""
        lp = cls._ln_params(p)
        return lp.cls.activation_bytes(lp, split_decoder_inputs(input_spec)[0])
