"""Transformer decoder layer: causal self-attention, cross-attention over the encoder output, feed-forward.

Pipeline contract. `fprop` takes and returns the 4-tuple

    (x [B, T, model_dim], tgt_paddings [B, T], memory [B, S, model_dim], src_paddings [B, S])

with only x replaced, so a stack of decoder layers can be split into GPipe stages: the encoder output and both
masks travel with each micro-batch from stage to stage (every leaf has the batch as its leading dimension, which
is what the pipeline splits). Paddings are floats, 1.0 = padding. Either paddings may be None when a layer is
called directly, but not inside a pipeline, whose micro-batch split needs tensors: pass zeros there.

Incremental decoding. `extend_step` runs the layer on one new position per sequence, attending over the keys and
values of earlier positions kept in a cache, and gives the same output as `fprop` at that position. The cache is a
dict of fixed-size buffers so that a `tf.while_loop` decoder keeps static shapes in its loop state:

    {"key":   [B, max_length, num_heads, head_dim]   self-attention keys, row t written at step t,
     "value": [B, max_length, num_heads, head_dim]   self-attention values,
     "step":  [B] int32                              the position the next call writes (same for all rows
                                                     in ordinary decoding; one per row so that every leaf has
                                                     the batch as leading dimension and beam search can
                                                     tile and reorder the cache like any other state),
     "cross_key", "cross_value": [B, S, num_heads, head_dim], optional: the projected memory, computed once by
                                                     `init_cache(..., memory=...)` instead of at every step}

Fixed buffers rather than growing ones (concatenating a new row per step) keep every loop variable's shape
constant, which `tf.while_loop` requires without shape invariants, and let XLA compile one step for all t; the
price is attention over max_length keys per step, with the not-yet-written ones masked out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.attention import FeedForward, MultiHeadAttention, causal_bias, large_negative_number, padding_bias
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.normalization import LayerNorm
from gpipe_tf.layers.transformer import define_block_params, residual_block

_BLOCKS = ("self_atten", "cross_atten", "ffn")


def split_decoder_inputs(inputs: Any) -> tuple[Any, Any, Any, Any]:
    """(x, tgt_paddings, memory, src_paddings) from the decoder's 4-tuple (or 4-list) input; checks its length."""
    if not isinstance(inputs, (tuple, list)) or len(inputs) != 4:
        got = f"a sequence of {len(inputs)}" if isinstance(inputs, (tuple, list)) else type(inputs).__name__
        raise ValueError(f"decoder inputs must be (x, tgt_paddings, memory, src_paddings), got {got}")
    return inputs[0], inputs[1], inputs[2], inputs[3]


class TransformerDecoderLayer(BaseLayer):
    """One Transformer decoder layer: causal self-attention, cross-attention, feed-forward; see the module doc.

    pre_norm=True:  each block computes x + drop(block(LN(x))); cross-attention normalizes only its queries (the
                    memory is the encoder's output, normalized by the encoder stack's final layer norm).
    pre_norm=False: each block computes LN(x + drop(block(x))).

    Self-attention masks future positions and padded target positions; cross-attention masks padded source
    positions. Outputs at padded target positions are computed but not meaningful.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params, the same fields as TransformerEncoderLayer's: model_dim, num_heads, hidden_dim, ..."""
        return define_block_params(super().params())

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        # One definition serves __init__, num_params and flops, so counts cannot drift from what is built.
        if p.model_dim <= 0 or p.num_heads <= 0 or p.hidden_dim <= 0:
            raise ParamsError(f"{p.name or 'transformer_decoder_layer'}: model_dim, num_heads and hidden_dim must be "
                              f"> 0, got {p.model_dim}, {p.num_heads} and {p.hidden_dim}")
        # create_child passes down only dtype and seed; the weight matrices should follow this layer's params_init.
        attention = MultiHeadAttention.params().set(
            model_dim=p.model_dim, num_heads=p.num_heads, head_dim=p.head_dim,
            attention_dropout_rate=p.attention_dropout_rate, params_init=p.params_init.copy())
        children: dict[str, InstantiableParams] = {}
        for block in _BLOCKS:
            children[f"{block}_ln"] = LayerNorm.params().set(dim=p.model_dim, epsilon=p.ln_epsilon)
            if block == "ffn":
                children[block] = FeedForward.params().set(
                    model_dim=p.model_dim, hidden_dim=p.hidden_dim, activation=p.activation,
                    dropout_rate=p.relu_dropout_rate, params_init=p.params_init.copy())
            else:
                children[block] = attention.copy()
            children[f"{block}_residual_dropout"] = Dropout.params().set(rate=p.dropout_rate)
        return children

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self._head_dim = MultiHeadAttention.resolved_head_dim(self.p)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    # ------------------------------------------------------------------------------------------ full pass

    def _residual_block(self, theta: Mapping[str, Any], x: tf.Tensor, block: str,
                        block_fn: Callable[[tf.Tensor], tf.Tensor], ctx: FPropContext) -> tf.Tensor:
        """One sub-block with its residual and layer norm, placed by `pre_norm`."""
        return residual_block(self, theta, x, block, block_fn, ctx)

    def _cross_and_ffn(self, theta: Mapping[str, Any], x: tf.Tensor, cross_fn: Callable[[tf.Tensor], tf.Tensor],
                       ctx: FPropContext) -> tf.Tensor:
        """The cross-attention and feed-forward blocks, shared by `fprop` and `extend_step`."""
        ffn = self.children["ffn"]
        x = self._residual_block(theta, x, "cross_atten", cross_fn, ctx)
        return self._residual_block(theta, x, "ffn", lambda h: ffn.fprop(theta["ffn"], h, ctx), ctx)

    def _padding_bias(self, paddings: Any) -> Any:
        # Built in the layer's dtype so that its masking value is safe for that dtype.
        return None if paddings is None else padding_bias(tf.cast(paddings, self.dtype))

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """(x, tgt_paddings, memory, src_paddings) -> the same 4-tuple (or list) with x replaced."""
        x, tgt_paddings, memory, src_paddings = split_decoder_inputs(inputs)
        self_bias = causal_bias(tf.shape(x)[1], self.dtype)
        if tgt_paddings is not None:
            self_bias += self._padding_bias(tgt_paddings)
        cross_bias = self._padding_bias(src_paddings)
        self_atten, cross_atten = self.children["self_atten"], self.children["cross_atten"]
        x = self._residual_block(
            theta, x, "self_atten", lambda h: self_atten.fprop(theta["self_atten"], (h, h, self_bias), ctx), ctx)
        x = self._cross_and_ffn(
            theta, x, lambda h: cross_atten.fprop(theta["cross_atten"], (h, memory, cross_bias), ctx), ctx)
        outputs = (x, tgt_paddings, memory, src_paddings)
        return outputs if isinstance(inputs, tuple) else list(outputs)

    # ---------------------------------------------------------------------------------- incremental decoding

    def init_cache(self, batch_size: int | tf.Tensor, max_length: int, theta: Mapping[str, Any] | None = None,
                   memory: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
        """An empty cache for `batch_size` sequences of up to `max_length` positions (format: module doc).

        With `memory` [B, S, model_dim] (and `theta`, default this layer's weights), the cross-attention keys and
        values are projected once here and `extend_step` then ignores its `memory` argument.
        """
        shape = tf.stack([batch_size, max_length, self.p.num_heads, self._head_dim])
        cache = {"key": tf.zeros(shape, self.fprop_dtype), "value": tf.zeros(shape, self.fprop_dtype),
                 "step": tf.zeros(tf.reshape(batch_size, [1]), tf.int32)}
        if memory is not None:
            theta = self.fprop_theta if theta is None else theta
            cross, ct = self.children["cross_atten"], theta["cross_atten"]
            ctx = FPropContext(training=False)  # projections are deterministic: no dropout inside them
            cache["cross_key"] = cross.project(ct, "key", memory, ctx)
            cache["cross_value"] = cross.project(ct, "value", memory, ctx)
        return cache

    def extend_step(self, theta: Mapping[str, Any], x_step: tf.Tensor, cache: Mapping[str, tf.Tensor],
                    memory: tf.Tensor | None, src_paddings: tf.Tensor | None,
                    ctx: FPropContext) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        """Runs the layer on one new position per sequence: x_step [B, 1, model_dim] -> (y_step, new cache).

        Row b is taken to be at position cache["step"][b]: its self-attention key and value are written there and
        it attends to positions 0 .. step. The output equals `fprop`'s at that position for the sequence of all
        steps so far (without target paddings). `memory` [B, S, model_dim] may be None if the cache holds the
        projected memory; the caller keeps step < max_length (an out-of-range write fails on CPU and is dropped
        on GPU). Decoding normally runs with ctx.training False: in training, dropout draws masks of a step's
        shape from ctx.seed, unlike `fprop`'s.
        """
        self_atten, ts = self.children["self_atten"], theta["self_atten"]
        keys, values, step = cache["key"], cache["value"], cache["step"]
        max_length = tf.shape(keys)[1]
        # Row b's new key and value go to index (b, step[b]): a scatter writes B rows instead of rewriting the
        # whole buffer through a one-hot mask, and copies them exactly.
        index = tf.stack([tf.range(tf.shape(step)[0], dtype=step.dtype), step], axis=1)
        written = tf.range(max_length, dtype=step.dtype)[tf.newaxis, :] <= step[:, tf.newaxis]
        self_bias = tf.where(written, tf.zeros([], self.dtype),
                             tf.constant(large_negative_number(self.dtype), self.dtype))[:, tf.newaxis, tf.newaxis]
        new_cache = dict(cache)

        def self_attend(h: tf.Tensor) -> tf.Tensor:
            q = self_atten.project(ts, "query", h, ctx)
            k = self_atten.project(ts, "key", h, ctx)
            v = self_atten.project(ts, "value", h, ctx)
            new_cache["key"] = tf.tensor_scatter_nd_update(keys, index, k[:, 0])
            new_cache["value"] = tf.tensor_scatter_nd_update(values, index, v[:, 0])
            return self_atten.attend_heads(ts, q, new_cache["key"], new_cache["value"], self_bias, ctx)[0]

        cross_atten, tc = self.children["cross_atten"], theta["cross_atten"]
        cross_bias = self._padding_bias(src_paddings)

        def cross_attend(h: tf.Tensor) -> tf.Tensor:
            q = cross_atten.project(tc, "query", h, ctx)
            if "cross_key" in cache:
                k, v = cache["cross_key"], cache["cross_value"]
            elif memory is None:
                raise ValueError(f"{self.path}.extend_step: memory is None and the cache holds no projected memory; "
                                 "pass memory, or build the cache with init_cache(..., memory=memory)")
            else:
                k = cross_atten.project(tc, "key", memory, ctx)
                v = cross_atten.project(tc, "value", memory, ctx)
            return cross_atten.attend_heads(tc, q, k, v, cross_bias, ctx)[0]

        y = self._residual_block(theta, x_step, "self_atten", self_attend, ctx)
        y = self._cross_and_ffn(theta, y, cross_attend, ctx)
        new_cache["step"] = step + 1
        return y, new_cache

    # ----------------------------------------------------------------------------- Params-only cost estimates

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Sum of the children: self-attention, cross-attention, feed-forward and three layer norms."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> Any:
        """`input_spec` unchanged: x keeps its shape and dtype, memory and paddings pass through."""
        split_decoder_inputs(input_spec)
        return input_spec

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Sum of the children's flops: cross-attention on (x, memory), everything else on x.

        `input_spec` is the (x, tgt_paddings, memory, src_paddings) specs; the paddings' specs are not used.
        """
        x_spec, _, memory_spec, _ = split_decoder_inputs(input_spec)
        total = 0.0
        for name, cp in cls._child_params(p).items():
            total += cp.cls.flops(cp, (x_spec, memory_spec, None) if name == "cross_atten" else x_spec)
        return total

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Sum of the children (cross-attention on (x, memory); each residual sum stands in for the block output it
        replaces, see `transformer.block_activation_bytes`) and the attention biases."""
        x_spec, tgt_paddings, memory_spec, src_paddings = split_decoder_inputs(input_spec)
        total = 0
        for name, cp in cls._child_params(p).items():
            total += cp.cls.activation_bytes(cp, (x_spec, memory_spec, None) if name == "cross_atten" else x_spec)
        biases = sum(elements_bytes(s, "float32") for s in (tgt_paddings, src_paddings) if s is not None)
        return total + biases
