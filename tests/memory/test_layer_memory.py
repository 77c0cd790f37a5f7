"""The memory model of single layers (`activation_bytes`) against hand arithmetic, and its clear failure."""

import pytest
import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.layers.attention import MultiHeadAttention
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.normalization import LayerNorm
from gpipe_tf.layers.amoebanet.ops import SepConv
from gpipe_tf.memory import stage
from tests.helpers.pipeline_models import PairConv


def test_linear_keeps_its_relu_output_only():
    p = Linear.params().set(input_dim=3, output_dim=5, activation="relu")
    # [4, 5] float32: the ReLU's output, which its gradient and the next layer's read.
    assert Linear.activation_bytes(p, tf.TensorSpec([4, 3], tf.float32)) == 4 * 5 * 4
    gelu = Linear.params().set(input_dim=3, output_dim=5, activation="gelu")
    assert Linear.activation_bytes(gelu, tf.TensorSpec([4, 3], tf.float32)) == 5 * 4 * 5 * 4


def test_layer_norm_in_float32_and_bfloat16():
    p = LayerNorm.params().set(dim=8)
    elements = 2 * 7 * 8
    assert LayerNorm.activation_bytes(p, tf.TensorSpec([2, 7, 8], tf.float32)) == 2 * elements * 4
    # bfloat16 input: float32 copy, intermediate and output, plus the bfloat16 output.
    assert LayerNorm.activation_bytes(p, tf.TensorSpec([2, 7, 8], tf.bfloat16)) == 3 * elements * 4 + elements * 2


def test_self_attention_by_hand():
    p = MultiHeadAttention.params().set(model_dim=8, num_heads=2)
    b, t, d, h = 2, 5, 8, 2
    q_k_v = 3 * b * t * d * 4           # the scaled q, k and v
    probs = b * h * t * t * 4           # the softmax output
    context_and_out = 2 * b * t * d * 4
    assert MultiHeadAttention.activation_bytes(p, tf.TensorSpec([b, t, d])) == q_k_v + probs + context_and_out


def test_sep_conv_counts_its_repeats():
    p = SepConv.params().set(input_dim=4, output_dim=6, kernel_size=3, stride=1)
    x = tf.TensorSpec([2, 5, 5, 4])
    n_in, n_out = 2 * 5 * 5 * 4 * 4, 2 * 5 * 5 * 6 * 4
    # Leading ReLU (input-sized); depthwise_0 (input-sized), pointwise_0, ReLU before depthwise_1, depthwise_1,
    # pointwise_1 (output-sized); the output.
    assert SepConv.activation_bytes(p, x) == n_in + n_in + 4 * n_out + n_out


def test_a_layer_that_cannot_estimate_is_named():
    layers = [Linear.params().set(input_dim=2, output_dim=2), PairConv.params()]
    with pytest.raises(ConfigError) as raised:
        stage.trace_layers(layers, tf.TensorSpec([4, 2]), ["layer_0", "layer_1"])
    message = str(raised.value)
    assert "layer_1 (PairConv)" in message and "PairConv.output_spec is missing" in message, message
