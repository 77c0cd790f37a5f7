"""The forward matmul's operand layout: the rule that chooses it, and the same product and gradients either way."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.layers import matmul_layout, weight_gradients

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


def _product_and_gradients(x, w, watched):
    """(y, dL/dx, dL/dw or the stash's batched dW, the forward graph's op types) of L = sum(sin(x @ w))."""
    stash = weight_gradients.WeightStash()

    @tf.function(autograph=False)
    def run(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            if watched:
                with stash.watching([w]):
                    y = weight_gradients.matmul(x, w)
            else:
                y = weight_gradients.matmul(x, w)
            loss = tf.reduce_sum(tf.sin(y))
        dx, dw = tape.gradient(loss, [x, w])
        if watched:
            dw = weight_gradients.weight_gradient([r.x for r in stash.records], [r.dy for r in stash.records])
            stash.records.clear()
        return y, dx, dw

    graph = run.get_concrete_function(x, w).graph
    return (*[t.numpy() for t in run(x, w)], {op.type for op in graph.get_operations()})


@pytest.mark.parametrize("watched", [False, True])
@pytest.mark.parametrize("layout", ["plain", "transposed"])
@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 3)])
def test_either_layout_computes_the_product_and_its_gradients(monkeypatch, layout, watched, shape):
    monkeypatch.setenv("GPIPE_TF_MATMUL_LAYOUT", layout)
    x = tf.constant(RNG.normal(size=shape))
    w = tf.constant(RNG.normal(size=(3, 5)))
    y, dx, dw, ops = _product_and_gradients(x, w, watched)
    x2 = x.numpy().reshape(-1, 3)
    want = x2 @ w.numpy()
    dy = np.cos(want)
    np.testing.assert_allclose(y.reshape(-1, 5), want, rtol=1e-12)
    np.testing.assert_allclose(dx.reshape(-1, 3), dy @ w.numpy().T, rtol=1e-12)
    np.testing.assert_allclose(dw, x2.T @ dy, rtol=1e-12)
    # The transposed form is really taken (and kept from Grappler's fold by the EnsureShape), the plain one is not.
    assert ("EnsureShape" in ops) is (layout == "transposed")


def test_a_plain_block_keeps_the_plain_form_whatever_the_setting():
    with matmul_layout.plain():
        assert not matmul_layout.use_transposed(256, "", "transposed", True)
        with matmul_layout.plain():
            assert not matmul_layout.use_transposed(256, "", "auto", True)
        assert not matmul_layout.use_transposed(256, "", "auto", True)
    assert matmul_layout.use_transposed(256, "", "transposed", True)
