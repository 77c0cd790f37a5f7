"""The forward matmul's operand layout: the rule that chooses it, and the same product and gradients either way."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.grappler import tf_optimizer

from gpipe_tf.layers import matmul_layout
from tests.helpers.deferred_matmul import sin_loss_gradients

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("environ, flags, below", [
    ({}, {"avx2", "avx512f"}, False),
    ({}, {"avx2", "fma"}, True),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"avx2", "avx512f"}, True),
    ({"DNNL_MAX_CPU_ISA": "avx2_vnni"}, {"avx2", "avx512f"}, True),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, {"avx2", "avx512f"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "ALL"}, {"avx2"}, True),  # no cap, and the CPU has no AVX-512
    ({"TF_ENABLE_ONEDNN_OPTS": "0"}, {"avx2"}, False),  # TensorFlow's own kernels: the rule is oneDNN's
    ({"TF_ENABLE_ONEDNN_OPTS": "0", "ONEDNN_MAX_CPU_ISA": "AVX2"}, {"avx2"}, False),
    ({}, set(), False),  # no flags to read: no rule
])
def test_onednn_below_avx512_reads_the_caps_and_the_cpu(environ, flags, below):
    assert matmul_layout.onednn_below_avx512(environ, flags) is below


@pytest.mark.parametrize("rows, device, setting, below, transposed", [
    (256, "/job:w/task:0/device:CPU:0", "auto", True, True),
    (128, "", "auto", True, True),
    (1023, "", "auto", True, True),
    (127, "", "auto", True, False),
    (1024, "", "auto", True, False),
    (None, "", "auto", True, False),
    (256, "", "auto", False, False),
    (256, "/device:GPU:0", "auto", True, False),
    (256, "/device:TPU:1", "transposed", True, False),
    (4096, "", "transposed", False, True),
    (256, "", "plain", True, False),
])
def test_the_rule_takes_the_transposed_form_on_cpu_for_the_rows_it_measured_faster(rows, device, setting, below,
                                                                                  transposed):
    assert matmul_layout.use_transposed(rows, device, setting, below) is transposed


def test_an_unknown_layout_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", "nt")
    with pytest.raises(ValueError, match="'nt'.*auto, plain, transposed"):
        matmul_layout.layout_setting()


@pytest.mark.parametrize("watched", [False, True])
@pytest.mark.parametrize("layout", ["plain", "transposed"])
@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 3)])
def test_either_layout_computes_the_product_and_its_gradients(monkeypatch, layout, watched, shape):
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", layout)
    x = tf.constant(RNG.normal(size=shape))
    w = tf.constant(RNG.normal(size=(3, 5)))
    out = sin_loss_gradients(x, w, watched)
    x2 = x.numpy().reshape(-1, 3)
    want = x2 @ w.numpy()
    dy = np.cos(want)
    np.testing.assert_allclose(out["y"].numpy().reshape(-1, 5), want, rtol=1e-12)
    np.testing.assert_allclose(out["dx"].numpy().reshape(-1, 3), dy @ w.numpy().T, rtol=1e-12)
    np.testing.assert_allclose((out["batched_w"] if watched else out["dw"]).numpy(), x2.T @ dy, rtol=1e-12)
    assert ("EnsureShape" in out["ops"]) is (layout == "transposed")  # the transposed form is really taken


def _optimized_matmuls(product):
    """(transpose_b, input op names) of each MatMul in the graph of `product(x, w)` after Grappler's rewrites."""
    @tf.function(autograph=False)
    def run(x, w):
        return product(x, w)

    concrete = run.get_concrete_function(tf.TensorSpec([4, 3]), tf.TensorSpec([3, 5]))
    graph = concrete.graph
    for t in concrete.outputs:
        graph.add_to_collection("train_op", t.op)  # what Grappler must keep
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    optimized = tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta)
    return [(n.attr["transpose_b"].b, list(n.input)) for n in optimized.node if n.op == "MatMul"]


def test_grappler_keeps_the_transposed_weight_where_it_folds_a_bare_transpose(monkeypatch):
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", "transposed")
    # The control: a transpose behind an Identity is folded back into the plain product (the slow kernel).
    assert _optimized_matmuls(lambda x, w: tf.matmul(x, tf.identity(tf.transpose(w)), transpose_b=True)) == [
        (False, ["x", "w"])]
    [(transpose_b, inputs)] = _optimized_matmuls(matmul_layout.forward)
    assert transpose_b and inputs[1] != "w", inputs


def test_a_plain_block_keeps_the_plain_form_whatever_the_setting():
    with matmul_layout.plain():
        assert not matmul_layout.use_transposed(256, "", "transposed", True)
        with matmul_layout.plain():
            assert not matmul_layout.use_transposed(256, "", "auto", True)
        assert not matmul_layout.use_transposed(256, "", "auto", True)
    assert matmul_layout.use_transposed(256, "", "transposed", True)


def _transposes_and_operands(fn, gated: bool) -> list[tuple[list[str], str]]:
    """Traces fn(x, w) on x = xs[i] * 2 in a while loop's body (inside `transposes_after_inputs` or not) and returns,
    for every Transpose op, the names of its control inputs and the name of that x's op."""
    found = []
    xs, w = tf.zeros([3, 4, 5]), tf.zeros([5, 6])

    def body(i, acc):
        x = xs[i] * 2.0
        y = fn(x, w)
        graph = tf.compat.v1.get_default_graph()
        found.extend(([c.name for c in op.control_inputs], x.op.name) for op in graph.get_operations()
                     if op.type == "Transpose")
        return i + 1, acc + tf.reduce_sum(y)

    @tf.function(autograph=False)
    def run():
        return tf.while_loop(lambda i, acc: i < 3, body, (tf.constant(0), tf.constant(0.0)), parallel_iterations=3)[1]

    with matmul_layout.transposes_after_inputs() if gated else contextlib.nullcontext():
        run.get_concrete_function()
    return found


@pytest.mark.parametrize("fn", [matmul_layout.forward, matmul_layout.product])
def test_the_transpose_waits_for_the_iterations_input_where_asked(monkeypatch, fn):
    # A transpose of the weight alone runs as soon as its iteration starts: with M iterations in flight, M copies of
    # every weight alive at once (measured: 1F1B's devices held 3.3x their stashes' memory with AVX2 kernels).
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", "transposed")
    [(controls, x_name)] = _transposes_and_operands(fn, gated=True)
    assert controls == [x_name]
    # Elsewhere it stays free of the input: Unrolled's micro-batches share one per weight, and a loop of one
    # iteration at a time (FillDrain's default) makes it while waiting for the previous stage.
    [(controls, _)] = _transposes_and_operands(fn, gated=False)
    assert controls == []


def _host_loop_transpose_controls(parallel: int) -> list[int]:
    """The control-input counts of the Transpose ops a forward makes in `loop_parts.host_loop`'s body."""
    from gpipe_tf.gpipe import loop_parts

    w, controls = tf.zeros([5, 6]), []

    def body(acc):
        matmul_layout.forward(acc[:, :5] + 1.0, w)
        controls.extend(len(op.control_inputs) for op in tf.compat.v1.get_default_graph().get_operations()
                        if op.type == "Transpose")
        return acc * 2.0

    tf.function(lambda: loop_parts.host_loop(body, tf.zeros([4, 6]), 4, parallel),
                autograph=False).get_concrete_function()
    return controls


def test_host_loop_asks_for_it_only_with_several_iterations_at_once(monkeypatch):
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", "transposed")
    assert _host_loop_transpose_controls(4) == [1]
    assert _host_loop_transpose_controls(1) == [0]
