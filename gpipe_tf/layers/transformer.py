"""Transformer encoder layer: self-attention and feed-forward blocks, each with a residual and layer norm."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.attention import FeedForward, MultiHeadAttention, causal_bias, padding_bias
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.normalization import LayerNorm


def _split_inputs(inputs: Any) -> tuple[Any, Any]:
    """(x, paddings or None) from a bare x or an (x, paddings) pair."""
    if isinstance(inputs, (tuple, list)):
        if len(inputs) != 2:
            raise ValueError(f"encoder inputs must be x or (x, paddings), got a sequence of {len(inputs)}")
        return inputs[0], inputs[1]
    return inputs, None


def residual_block(layer: BaseLayer, theta: Mapping[str, Any], x: tf.Tensor, block: str,
                   block_fn: Callable[[tf.Tensor], tf.Tensor], ctx: FPropContext) -> tf.Tensor:
    """One sub-block of `layer` with its residual and layer norm, placed by `layer.p.pre_norm`.

    `block` names the layer's '<block>_ln' and '<block>_residual_dropout' children (encoder and decoder layers).
    """
    ln_name, dropout_name = f"{block}_ln", f"{block}_residual_dropout"
    ln, dropout = layer.children[ln_name], layer.children[dropout_name]
    if layer.p.pre_norm:
        out = block_fn(ln.fprop(theta[ln_name], x, ctx))
        return x + dropout.fprop(theta[dropout_name], out, ctx)
    out = block_fn(x)
    return ln.fprop(theta[ln_name], x + dropout.fprop(theta[dropout_name], out, ctx), ctx)


def block_activation_bytes(children: dict[str, InstantiableParams], input_spec: Any) -> int:
    """Activation bytes of an encoder layer: its children's on x's spec (self-attention) and the attention bias
    when paddings come along."""
    x_spec, paddings = _split_inputs(input_spec)
    total = sum(cp.cls.activation_bytes(cp, x_spec) for cp in children.values())
    bias = 0 if paddings is None else elements_bytes(paddings, "float32")
    # Each block's output goes into its residual add, whose gradient reads neither operand, so it is not kept; the
    # sum, of the same size, is (the next layer norm reads it): the children's count stands for both.
    return total + bias


def define_block_params(p: InstantiableParams) -> InstantiableParams:
    """Defines the fields Transformer encoder and decoder layers share (one definition for both); returns p."""
    p.define("model_dim", 0, "Size of the input and output (last) dimension (and of the decoder's memory).")
    p.define("num_heads", 0, "Number of attention heads (self- and cross-attention).")
    p.define("head_dim", 0, "Size of each attention head; 0: model_dim // num_heads.")
    p.define("hidden_dim", 0, "Hidden size of the feed-forward block.")
    p.define("activation", "relu", "Activation of the feed-forward hidden layer.")
    p.define("dropout_rate", 0.0, "Residual dropout: on each block's output before it is added to x.")
    p.define("attention_dropout_rate", 0.0, "Dropout on the attention probabilities.")
    p.define("relu_dropout_rate", 0.0, "Dropout on the feed-forward hidden activations.")
    p.define("pre_norm", True, "True: normalize each block's input; False: normalize after the residual add.")
    p.define("ln_epsilon", 1e-6, "Epsilon of the layer norms.")
    return p


class TransformerEncoderLayer(BaseLayer):
    """One Transformer encoder layer: self-attention then feed-forward, each with residual dropout and layer norm.

    pre_norm=True:  y = x + drop(attn(LN(x)));  out = y + drop(ffn(LN(y))).
    pre_norm=False: y = LN(x + drop(attn(x)));  out = LN(y + drop(ffn(y))).
    A pre-norm stack usually ends with one more LayerNorm; that belongs to the model, not to this layer.

    `fprop` takes either x [B, T, model_dim] (no mask) and returns the new x, or (x, paddings) with paddings
    [B, T] (1.0 = padding) and returns (new x, the same paddings), so that the mask travels with each micro-batch
    through a pipelined stack. Padded keys are masked out; outputs at padded positions are computed but not
    meaningful. With `causal`, position t attends to positions <= t only: a language model's layer (no decoder
    cross-attention), which needs no paddings when padding only follows the tokens.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: model_dim, num_heads, hidden_dim, dropout rates, pre_norm, ln_epsilon, causal."""
        p = define_block_params(super().params())
        p.define("causal", False, "Mask every key after the query's position (a language model's self-attention).")
        return p

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        # One definition serves __init__, num_params and flops, so counts cannot drift from what is built.
        if p.model_dim <= 0 or p.num_heads <= 0 or p.hidden_dim <= 0:
            raise ParamsError(f"{p.name or 'transformer_encoder_layer'}: model_dim, num_heads and hidden_dim must be "
                              f"> 0, got {p.model_dim}, {p.num_heads} and {p.hidden_dim}")
        # create_child passes down only dtype and seed; the weight matrices should follow this layer's params_init.
        init = p.params_init
        return {
            "atten_ln": LayerNorm.params().set(dim=p.model_dim, epsilon=p.ln_epsilon),
            "self_atten": MultiHeadAttention.params().set(
                model_dim=p.model_dim, num_heads=p.num_heads, head_dim=p.head_dim,
                attention_dropout_rate=p.attention_dropout_rate, params_init=init.copy()),
            "atten_residual_dropout": Dropout.params().set(rate=p.dropout_rate),
            "ffn_ln": LayerNorm.params().set(dim=p.model_dim, epsilon=p.ln_epsilon),
            "ffn": FeedForward.params().set(
                model_dim=p.model_dim, hidden_dim=p.hidden_dim, activation=p.activation,
                dropout_rate=p.relu_dropout_rate, params_init=init.copy()),
            "ffn_residual_dropout": Dropout.params().set(rate=p.dropout_rate),
        }

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    def _residual_block(self, theta: Mapping[str, Any], x: tf.Tensor, block: str,
                        block_fn: Callable[[tf.Tensor], tf.Tensor], ctx: FPropContext) -> tf.Tensor:
        return residual_block(self, theta, x, block, block_fn, ctx)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """x -> new x, or (x, paddings) -> (new x, paddings); see the class doc."""
        x, paddings = _split_inputs(inputs)
        # The bias is built in the layer's dtype so that its masking value is safe for that dtype.
        bias = None if paddings is None else padding_bias(tf.cast(paddings, self.dtype))
        if self.p.causal:
            causal = causal_bias(tf.shape(x)[1], self.dtype)
            bias = causal if bias is None else bias + causal
        attention, ffn = self.children["self_atten"], self.children["ffn"]
        x = self._residual_block(
            theta, x, "atten", lambda h: attention.fprop(theta["self_atten"], (h, h, bias), ctx), ctx)
        x = self._residual_block(theta, x, "ffn", lambda h: ffn.fprop(theta["ffn"], h, ctx), ctx)
        if paddings is None:
            return x
        return (x, paddings) if isinstance(inputs, tuple) else [x, paddings]

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Sum of the children: attention, feed-forward and two layer norms."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> Any:
        """`input_spec` unchanged (x keeps its shape and dtype; paddings pass through)."""
        return input_spec

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Sum of the children's flops on x's spec (`input_spec` is x's spec or the (x, paddings) specs)."""
        x_spec, _ = _split_inputs(input_spec)
        return sum(cp.cls.flops(cp, x_spec) for cp in cls._child_params(p).values())

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Sum of the children on x's spec (and, with paddings, the attention bias)."""
        return block_activation_bytes(cls._child_params(p), input_spec)
