"""The memory model of single layers (`activation_bytes`) against hand arithmetic, and its clear failure."""

import pytest
import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.layers.amoebanet.cells import Cell
from gpipe_tf.layers.amoebanet.network import amoebanet_layers
from gpipe_tf.layers.amoebanet.ops import SepConv
from gpipe_tf.layers.attention import MultiHeadAttention
from gpipe_tf.layers.linear import Linear
from gpipe_tf.layers.normalization import LayerNorm
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


def test_a_cell_keeps_its_output_only_where_a_later_cell_reads_it_directly():
    # Genotype D concatenates 4 (normal) or 3 (reduction) states: a later cell always adjusts such an output with
    # a ReLU first (which keeps its own output), so the concatenation is not kept.
    d_normal = Cell.params().set(genotype="D", reduction=False, filters=8, input_dim=32, skip_dim=32,
                                 skip_mode="same")
    d_reduction = d_normal.copy().set(reduction=True)
    assert not Cell.output_read_directly(d_normal) and not Cell.output_read_directly(d_reduction)
    # Genotype B's reduction cell concatenates 2 states (2 fs channels): the cell after next, a reduction at 2 fs
    # when N = 1, takes it unchanged as state 1, which a max pooling reads.
    b_reduction = Cell.params().set(genotype="B", reduction=True, filters=8, input_dim=32, skip_dim=32,
                                    skip_mode="same")
    assert Cell.output_read_directly(b_reduction)


def test_a_cells_count_includes_its_output_exactly_when_read_directly(monkeypatch):
    p = Cell.params().set(genotype="D", reduction=False, filters=8, input_dim=32, skip_dim=32, skip_mode="same")
    x = (tf.TensorSpec([2, 6, 6, 32]), tf.TensorSpec([2, 6, 6, 32]))
    without = Cell.activation_bytes(p, x)
    monkeypatch.setattr(Cell, "output_read_directly", classmethod(lambda cls, p: True))
    # [2, 6, 6, 4 * 8] float32: the concatenated output.
    assert Cell.activation_bytes(p, x) - without == 2 * 6 * 6 * 32 * 4


def test_a_stage_keeps_the_relu_two_cells_share_once():
    # The cell after the stem ReLUs the stem's output as its h[i-1]; the next cell ReLUs the same tensor as its
    # h[i-2] (its skip 1x1): one ReLU in the graph, counted once by the stage.
    layers = amoebanet_layers("D", 1, 8, 10, 32, stem="cifar")
    stem_out = layers[0].cls.output_spec(layers[0], tf.TensorSpec([2, 32, 32, 3]))  # 2 x [2, 30, 30, 32]
    cell0, cell1 = layers[1], layers[2]
    relu_bytes = 2 * 30 * 30 * 32 * 4
    assert Cell.shared_with_previous_bytes(cell0, stem_out) == 0  # no h[i-2] after the stem
    assert Cell.shared_with_previous_bytes(cell1, Cell.output_spec(cell0, stem_out)) == relu_bytes
    traces = stage.trace_layers([cell0, cell1], stem_out, ["cell0", "cell1"])
    setting = stage.StageSetting(micro_batches=1, stashed=1, remat=False, first=True, last=True,
                                 kept_outputs=2)
    mem = stage.stage_memory(traces, stem_out, setting)
    assert mem.stashed_activations == traces[0].activation_bytes + traces[1].activation_bytes - relu_bytes
    # Alone in its stage (its h[i-2] received from the previous stage), the cell keeps that ReLU itself.
    alone = stage.stage_memory(traces[1:], traces[0].output_spec, setting)
    assert alone.stashed_activations == traces[1].activation_bytes
