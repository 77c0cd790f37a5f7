"""NumPy references of the Transformer building blocks, shared by the layer tests."""

import numpy as np
import tensorflow as tf


def randomize(layer, rng, scale=0.5):
    """Random values for every variable, so that biases and layer-norm scales (constant at init) are exercised."""
    for v in layer.trainable_variables:
        v.assign(rng.normal(scale=scale, size=v.shape))
    return tf.nest.map_structure(lambda v: v.numpy(), layer.theta)


def np_linear(x, t):
    return x @ t["w"] + t["b"] if "b" in t else x @ t["w"]


def np_layer_norm(x, t, eps):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * t["scale"] + t["bias"]


def np_attention(t, query, memory, masked, num_heads):
    """Reference attention -> (output, probabilities); `masked` is a boolean array broadcastable to
    [B, H, Tq, Tk] (True = may not attend)."""
    def heads(x):
        return x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    q, k, v = heads(np_linear(query, t["query"])), heads(np_linear(memory, t["key"])), heads(
        np_linear(memory, t["value"]))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if masked is not None:
        logits = np.where(masked, -np.inf, logits)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(query.shape[0], query.shape[1], -1)
    return np_linear(out, t["post"]), probs


def num_variable_elements(layer):
    return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)
