"""Multi-head dot-product attention, the position-wise feed-forward block, and attention-bias helpers.

Masks are additive biases: 0 where a query may attend to a key and a large negative number where it may not, so
padding and causal masks combine by addition and broadcast against the [batch, heads, query, key] logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, sensitive_dtype
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.linear import Linear

# Not -inf: a query whose keys are all masked would then compute inf - inf = NaN in the softmax.
_LARGE_NEGATIVE = 1e9


def large_negative_number(dtype: tf.DType | str) -> float:
    """The masking value for `dtype`: -1e9, or a quarter of the dtype's most negative value if that is smaller.

    A quarter leaves room to add a padding and a causal bias and still stay finite in float16.
    """
    dtype = tf.as_dtype(dtype)
    return -min(_LARGE_NEGATIVE, 0.25 * float(dtype.max))


def padding_bias(paddings: tf.Tensor) -> tf.Tensor:
    """Attention bias [B, 1, 1, T] from `paddings` [B, T] (1.0 = padding): keys at padded positions are masked.

    The result has the dtype of `paddings` and broadcasts against logits [B, heads, Tq, T].
    """
    paddings = tf.convert_to_tensor(paddings)
    if not paddings.dtype.is_floating:
        raise TypeError(f"paddings must be a float tensor (1.0 = padding), got {paddings.dtype.name}")
    if paddings.shape.rank is not None and paddings.shape.rank != 2:
        raise ValueError(f"paddings must have shape [batch, time], got {paddings.shape}")
    return paddings[:, tf.newaxis, tf.newaxis, :] * large_negative_number(paddings.dtype)


def causal_bias(length: int | tf.Tensor, dtype: tf.DType | str = tf.float32) -> tf.Tensor:
    """Attention bias [1, 1, T, T] that masks every key after the query's own position (T = `length`)."""
    dtype = tf.as_dtype(dtype)
    allowed = tf.linalg.band_part(tf.ones(tf.stack([length, length]), dtype), -1, 0)
    return ((1.0 - allowed) * large_negative_number(dtype))[tf.newaxis, tf.newaxis]


def _unpack_attention_inputs(inputs: Any) -> tuple[Any, Any, Any]:
    """(query, memory, bias) from `inputs`; a bare query means self-attention without a mask."""
    if isinstance(inputs, (tuple, list)):
        if len(inputs) != 3:
            raise ValueError(f"attention inputs must be (query, memory, bias), got a sequence of {len(inputs)}")
        query, memory, bias = inputs
    else:
        query, memory, bias = inputs, None, None
    return query, (query if memory is None else memory), bias


def _static_dim(spec: tf.TensorSpec, axis: int, what: str) -> int:
    dim = spec.shape[axis]
    if dim is None:
        raise ParamsError(f"cost estimates need a static {what}, got shape {spec.shape}")
    return int(dim)


class MultiHeadAttention(BaseLayer):
    """Multi-head scaled dot-product attention of queries over a memory, with an additive attention bias.

    `fprop` takes `(query [B, Tq, model_dim], memory [B, Tk, model_dim], bias)`, where `bias` is None or an
    additive bias broadcastable to [B, num_heads, Tq, Tk] (see `padding_bias` and `causal_bias`), and returns
    [B, Tq, model_dim]. `memory` None (or a bare query tensor as `inputs`) means self-attention. Masked keys get
    exactly zero weight unless every key of a query is masked, in which case that query attends uniformly.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: model_dim, num_heads, head_dim, has_bias, attention_dropout_rate."""
        p = super().params()
        p.define("model_dim", 0, "Size of the query, memory and output (last) dimension.")
        p.define("num_heads", 0, "Number of attention heads.")
        p.define("head_dim", 0, "Size of each head; 0: model_dim // num_heads.")
        p.define("has_bias", True, "Whether the query, key, value and output projections have biases.")
        p.define("attention_dropout_rate", 0.0, "Dropout rate on the attention probabilities.")
        return p

    @classmethod
    def resolved_head_dim(cls, p: InstantiableParams) -> int:
        """`p.head_dim`, or model_dim // num_heads when it is 0; checks the Params."""
        if p.model_dim <= 0 or p.num_heads <= 0:
            raise ParamsError(f"{p.name or 'multi_head_attention'}: model_dim and num_heads must be > 0, got "
                              f"{p.model_dim} and {p.num_heads}")
        if p.head_dim:
            if p.head_dim < 0:
                raise ParamsError(f"{p.name or 'multi_head_attention'}.head_dim={p.head_dim} must be >= 0")
            return int(p.head_dim)
        if p.model_dim % p.num_heads:
            raise ParamsError(f"{p.name or 'multi_head_attention'}: model_dim={p.model_dim} is not divisible by "
                              f"num_heads={p.num_heads}; set head_dim explicitly")
        return p.model_dim // p.num_heads

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        # One definition serves __init__, num_params and flops, so counts cannot drift from what is built.
        inner = p.num_heads * cls.resolved_head_dim(p)
        # create_child passes down only dtype and seed; the projections should follow this layer's params_init.
        proj = Linear.params().set(has_bias=p.has_bias, params_init=p.params_init.copy())
        return {
            "query": proj.copy().set(input_dim=p.model_dim, output_dim=inner),
            "key": proj.copy().set(input_dim=p.model_dim, output_dim=inner),
            "value": proj.copy().set(input_dim=p.model_dim, output_dim=inner),
            "post": proj.copy().set(input_dim=inner, output_dim=p.model_dim),
            "atten_dropout": Dropout.params().set(rate=p.attention_dropout_rate),
        }

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self._head_dim = self.resolved_head_dim(self.p)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    def _split_heads(self, x: tf.Tensor) -> tf.Tensor:
        """[B, T, heads * head_dim] -> [B, T, heads, head_dim]."""
        shape = tf.concat([tf.shape(x)[:-1], [self.p.num_heads, self._head_dim]], 0)
        return tf.reshape(x, shape)

    def project(self, theta: Mapping[str, Any], name: str, x: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """The `name` ('query', 'key' or 'value') projection of x [B, T, model_dim], split: [B, T, heads, head_dim]."""
        return self._split_heads(self.children[name].fprop(theta[name], x, ctx))

    def attend_heads(self, theta: Mapping[str, Any], q: tf.Tensor, k: tf.Tensor, v: tf.Tensor, bias: Any,
                     ctx: FPropContext) -> tuple[tf.Tensor, tf.Tensor]:
        """Attention of projected heads (`project`): (output [B, Tq, model_dim], probabilities before dropout).

        Incremental decoding calls this with cached keys and values, so a step matches the full pass to rounding.
        """
        # Scaling q (Tq * head_dim elements) is cheaper than scaling the logits (Tq * Tk per head).
        # A Python float takes q's dtype here; tf.cast of a Python float would round it to float32 first.
        q *= self._head_dim ** -0.5
        logits = tf.einsum("bqnh,bknh->bnqk", q, k)
        # Half-precision softmax loses the small probabilities; the masked logits also need float32's range.
        compute_dtype = sensitive_dtype(logits.dtype)
        logits = tf.cast(logits, compute_dtype)
        if bias is not None:
            logits += tf.cast(bias, compute_dtype)
        probs = tf.cast(tf.nn.softmax(logits, axis=-1), v.dtype)
        ch = self.children
        dropped = ch["atten_dropout"].fprop(theta["atten_dropout"], probs, ctx)
        context = tf.einsum("bnqk,bknh->bqnh", dropped, v)
        context = tf.reshape(context, tf.concat([tf.shape(context)[:-2], [self.p.num_heads * self._head_dim]], 0))
        return ch["post"].fprop(theta["post"], context, ctx), probs

    def compute_attention(self, theta: Mapping[str, Any], query: tf.Tensor, memory: tf.Tensor, bias: Any,
                          ctx: FPropContext) -> tuple[tf.Tensor, tf.Tensor]:
        """Returns (output [B, Tq, model_dim], attention probabilities [B, heads, Tq, Tk] before dropout)."""
        q = self.project(theta, "query", query, ctx)
        k = self.project(theta, "key", memory, ctx)
        v = self.project(theta, "value", memory, ctx)
        return self.attend_heads(theta, q, k, v, bias, ctx)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> tf.Tensor:
        """Attends `query` over `memory`: inputs (query, memory, bias) -> [B, Tq, model_dim]."""
        query, memory, bias = _unpack_attention_inputs(inputs)
        return self.compute_attention(theta, query, memory, bias, ctx)[0]

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """4 * model_dim * heads * head_dim, plus 3 * heads * head_dim + model_dim if has_bias."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> tf.TensorSpec:
        """[B, Tq, model_dim] in the query's dtype; `input_spec` is the query spec or (query, memory, bias) specs."""
        query, _, _ = _unpack_attention_inputs(input_spec)
        return tf.TensorSpec(query.shape[:-1].concatenate([p.model_dim]), query.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Matmul flops: 2*B*(2*Tq + 2*Tk)*D*H*hd for the projections plus 2*2*B*H*Tq*Tk*hd for logits and context.

        `input_spec` is the query spec, or (query, memory, bias) specs. Without a memory spec this assumes
        self-attention (Tk = Tq), where the projections are the usual 2*B*T*D*H*hd*4. Softmax, bias and dropout
        are left out: elementwise over [B, H, Tq, Tk], they are a 1/hd fraction of the logits matmul.
        """
        query, memory, _ = _unpack_attention_inputs(input_spec)
        batch, tq = _static_dim(query, 0, "batch size"), _static_dim(query, 1, "query length")
        tk = _static_dim(memory, 1, "memory length")
        inner = p.num_heads * cls.resolved_head_dim(p)
        projections = 2.0 * batch * (2 * tq + 2 * tk) * p.model_dim * inner
        attention = 2.0 * 2.0 * batch * tq * tk * inner
        return projections + attention

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """The scaled q, k and v (the einsums' gradients read their operands), the softmax output [B, H, Tq, Tk]
        (its gradient reads it; in float32 for half inputs, plus the cast copy), the attention dropout's, the
        context and the output projection's output."""
        query, memory, _ = _unpack_attention_inputs(input_spec)
        batch, tq = _static_dim(query, 0, "batch size"), _static_dim(query, 1, "query length")
        tk = _static_dim(memory, 1, "memory length")
        inner = p.num_heads * cls.resolved_head_dim(p)
        size = tf.as_dtype(query.dtype).size
        wide = sensitive_dtype(query.dtype).size
        probs_elems = batch * p.num_heads * tq * tk
        probs = probs_elems * wide + (probs_elems * size if wide != size else 0)
        dropout = Dropout.activation_bytes(cls._child_params(p)["atten_dropout"],
                                           tf.TensorSpec([batch, p.num_heads, tq, tk], query.dtype))
        q_k_v = (tq + 2 * tk) * batch * inner * size  # the scaled q, k, v (scaling by a constant keeps nothing)
        return q_k_v + probs + dropout + batch * tq * inner * size + batch * tq * p.model_dim * size


class FeedForward(BaseLayer):
    """The position-wise feed-forward block: y = W2(dropout(activation(W1 x + b1))) + b2 over the last dim."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: model_dim, hidden_dim, activation, dropout_rate, has_bias."""
        p = super().params()
        p.define("model_dim", 0, "Size of the input and output (last) dimension.")
        p.define("hidden_dim", 0, "Size of the hidden layer.")
        p.define("activation", "relu", "Activation of the hidden layer (see activations.py).")
        p.define("dropout_rate", 0.0, "Dropout rate on the hidden activations.")
        p.define("has_bias", True, "Whether both projections have biases.")
        return p

    @classmethod
    def _child_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        if p.model_dim <= 0 or p.hidden_dim <= 0:
            raise ParamsError(f"{p.name or 'feed_forward'}: model_dim and hidden_dim must be > 0, got "
                              f"{p.model_dim} and {p.hidden_dim}")
        # create_child passes down only dtype and seed; the projections should follow this layer's params_init.
        proj = Linear.params().set(has_bias=p.has_bias, params_init=p.params_init.copy())
        return {
            "fc1": proj.copy().set(input_dim=p.model_dim, output_dim=p.hidden_dim, activation=p.activation),
            "dropout": Dropout.params().set(rate=p.dropout_rate),
            "fc2": proj.copy().set(input_dim=p.hidden_dim, output_dim=p.model_dim),
        }

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child_params in self._child_params(self.p).items():
            self.create_child(name, child_params)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """[..., model_dim] -> [..., model_dim]."""
        ch = self.children
        hidden = ch["fc1"].fprop(theta["fc1"], inputs, ctx)
        hidden = ch["dropout"].fprop(theta["dropout"], hidden, ctx)
        return ch["fc2"].fprop(theta["fc2"], hidden, ctx)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """2 * model_dim * hidden_dim, plus hidden_dim + model_dim if has_bias."""
        return sum(cp.cls.num_params(cp) for cp in cls._child_params(p).values())

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Same leading dims, last dim model_dim."""
        return tf.TensorSpec(input_spec.shape[:-1].concatenate([p.model_dim]), input_spec.dtype)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """Sum of the children: the two projections' matmuls and the hidden dropout."""
        children = cls._child_params(p)
        hidden_spec = Linear.output_spec(children["fc1"], input_spec)
        return (Linear.flops(children["fc1"], input_spec) + Dropout.flops(children["dropout"], hidden_spec)
                + Linear.flops(children["fc2"], hidden_spec))

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """Sum of the children: the hidden activations, the hidden dropout's and the output."""
        children = cls._child_params(p)
        hidden_spec = Linear.output_spec(children["fc1"], input_spec)
        return (Linear.activation_bytes(children["fc1"], input_spec)
                + Dropout.activation_bytes(children["dropout"], hidden_spec)
                + Linear.activation_bytes(children["fc2"], hidden_spec))
