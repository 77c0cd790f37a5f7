"""Adapters that turn an encoder-decoder Transformer into ONE flat layer list for GPipe.

A pipeline splits every leaf of its input along the batch dimension and hands each stage's output to the next
stage, so the whole sequence-to-sequence model must pass one structure from layer to layer. The layers here keep
all of a micro-batch's tensors together:

    (src_ids [B, S] int32, src_paddings [B, S], tgt_ids [B, T] int32, tgt_paddings [B, T])
      SourceEmbedding  -> (x [B, S, D], src_paddings, tgt_ids, tgt_paddings)
      EncoderBlock xN  -> the same structure, x replaced
      EncoderToDecoder -> (y [B, T, D], tgt_paddings, memory [B, S, D], src_paddings)
      TransformerDecoderLayer xM (its own 4-tuple contract)
      FinalNorm        -> decoder output [B, T, D]

Paddings are floats, 1.0 = padding. Each adapter reports num_params, output_spec and flops from Params alone so
that `inspect` and flops-based balancing work without building the model.
"""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext
from gpipe_tf.layers.normalization import LayerNorm
from gpipe_tf.layers.positions import TokenEmbeddingWithPositions
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from gpipe_tf.layers.transformer_decoder import split_decoder_inputs


def _four(inputs: Any, what: str) -> tuple[Any, Any, Any, Any]:
    """Unpacks a 4-tuple (or 4-list), naming the layer in the error."""
    if not isinstance(inputs, (tuple, list)) or len(inputs) != 4:
        raise ValueError(f"{what} expects the 4-tuple (src_ids or x, src_paddings, tgt_ids, tgt_paddings), got "
                         f"{type(inputs).__name__}")
    return inputs[0], inputs[1], inputs[2], inputs[3]


def _embedding_params(p: InstantiableParams) -> InstantiableParams:
    if p.vocab_size <= 0 or p.model_dim <= 0:
        raise ParamsError(f"{p.name or 'embedding'}: vocab_size and model_dim must be > 0, got {p.vocab_size} "
                          f"and {p.model_dim}")
    return TokenEmbeddingWithPositions.params().set(
        vocab_size=p.vocab_size, embedding_dim=p.model_dim, dropout_rate=p.dropout_rate)


class SourceEmbedding(BaseLayer):
    """(src_ids, src_paddings, tgt_ids, tgt_paddings) -> (x, src_paddings, tgt_ids, tgt_paddings).

    Embeds the source ids with sinusoidal positions; the target ids ride along untouched to EncoderToDecoder.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: vocab_size, model_dim, dropout_rate."""
        p = super().params()
        p.define("vocab_size", 0, "Number of token ids.")
        p.define("model_dim", 0, "Embedding size.")
        p.define("dropout_rate", 0.0, "Dropout on embeddings plus positions.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self.create_child("emb", _embedding_params(self.p))

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tuple[Any, Any, Any, Any]:
        """Replaces src_ids by their embeddings [B, S, model_dim]."""
        src_ids, src_paddings, tgt_ids, tgt_paddings = _four(inputs, self.path)
        x = self.children["emb"].fprop(theta["emb"], src_ids, ctx)
        return x, src_paddings, tgt_ids, tgt_paddings

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The embedding table: vocab_size * model_dim."""
        ep = _embedding_params(p)
        return ep.cls.num_params(ep)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> tuple[Any, Any, Any, Any]:
        """src_ids' spec becomes the embeddings' spec; the rest passes through."""
        src, src_pad, tgt, tgt_pad = _four(input_spec, cls.__name__)
        ep = _embedding_params(p).set(dtype=p.dtype)
        return ep.cls.output_spec(ep, src), src_pad, tgt, tgt_pad

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """The embedding's flops on the source ids."""
        src, _, _, _ = _four(input_spec, cls.__name__)
        ep = _embedding_params(p)
        return ep.cls.flops(ep, src)


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


class EncoderToDecoder(BaseLayer):
    """(x, src_paddings, tgt_ids, tgt_paddings) -> (y, tgt_paddings, memory, src_paddings).

    memory = LayerNorm(x), the pre-norm encoder stack's final norm; y embeds the target ids with positions.
    `encoder_memory` and `embed_target` expose the two halves for un-pipelined incremental decoding.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: vocab_size, model_dim, dropout_rate, ln_epsilon."""
        p = super().params()
        p.define("vocab_size", 0, "Number of target token ids.")
        p.define("model_dim", 0, "Embedding and encoder output size.")
        p.define("dropout_rate", 0.0, "Dropout on the target embeddings plus positions.")
        p.define("ln_epsilon", 1e-6, "Epsilon of the encoder's final layer norm.")
        return p

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        return {"encoder_ln": LayerNorm.params().set(dim=p.model_dim, epsilon=p.ln_epsilon),
                "tgt_emb": _embedding_params(p)}

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    def encoder_memory(self, theta: Mapping[str, Any], x: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """The encoder output normalized: [B, S, model_dim]."""
        return self.children["encoder_ln"].fprop(theta["encoder_ln"], x, ctx)

    def embed_target(self, theta: Mapping[str, Any], ids: tf.Tensor, positions: tf.Tensor,
                     ctx: FPropContext) -> tf.Tensor:
        """Target ids at explicit positions (decoding one step at a time): ids.shape + [model_dim]."""
        return self.children["tgt_emb"].fprop_with_positions(theta["tgt_emb"], ids, positions, ctx)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tuple[Any, Any, Any, Any]:
        """See the class doc."""
        x, src_paddings, tgt_ids, tgt_paddings = _four(inputs, self.path)
        memory = self.encoder_memory(theta, x, ctx)
        y = self.children["tgt_emb"].fprop(theta["tgt_emb"], tgt_ids, ctx)
        return y, tgt_paddings, memory, src_paddings

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The final encoder norm plus the target embedding table."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> tuple[Any, Any, Any, Any]:
        """(target embeddings, tgt_paddings, memory = x's spec, src_paddings)."""
        x, src_pad, tgt, tgt_pad = _four(input_spec, cls.__name__)
        ep = _embedding_params(p).set(dtype=p.dtype)
        return ep.cls.output_spec(ep, tgt), tgt_pad, x, src_pad

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Layer norm on x plus the target embedding."""
        x, _, tgt, _ = _four(input_spec, cls.__name__)
        children = cls._child_params(p)
        ln, emb = children["encoder_ln"], children["tgt_emb"]
        return ln.cls.flops(ln, x) + emb.cls.flops(emb, tgt)


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
