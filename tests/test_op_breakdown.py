"""bench.op_breakdown: op types fall into the documented categories, and a profiled step is attributed to them."""

import numpy as np
import pytest
import tensorflow as tf

from bench import op_breakdown


@pytest.mark.parametrize("op_type, expected", [
    ("MatMul", "matmul"), ("_MklNativeFusedMatMul", "matmul"), ("BatchMatMulV2", "matmul"),
    ("Einsum", "attention"), ("_MklSoftmax", "attention"), ("SoftmaxGrad", "attention"),
    ("Rsqrt", "normalization"), ("SquaredDifference", "normalization"),
    ("_Recv", "transfer"), ("_Send", "transfer"),
    ("AddV2", "elementwise"), ("ReluGrad", "elementwise"),
])
def test_category_of_op_types(op_type, expected):
    assert op_breakdown.category(op_type) == expected


def test_breakdown_attributes_a_profiled_step_to_its_ops():
    a = tf.constant(np.random.default_rng(0).standard_normal((256, 256)), tf.float32)

    @tf.function
    def matmuls() -> tf.Tensor:
        x = a
        for _ in range(8):
            x = tf.matmul(x, a) / 16.0
        return tf.reduce_sum(x)

    @tf.function
    def softmaxes() -> tf.Tensor:
        x = a
        for _ in range(8):
            x = tf.nn.softmax(x + a, axis=-1)
        return tf.reduce_sum(x)

    matmuls().numpy()
    softmaxes().numpy()
    m = op_breakdown.breakdown(lambda: matmuls().numpy(), steps=2)
    s = op_breakdown.breakdown(lambda: softmaxes().numpy(), steps=2)
    assert set(m) == set(op_breakdown.CATEGORIES) == set(s)
    assert m["matmul"] > 0 and m["attention"] == 0
    assert s["attention"] > 0 and s["matmul"] == 0
    assert all(v >= 0 for v in list(m.values()) + list(s.values()))
    line = op_breakdown.format_breakdown(m)
    assert line.startswith("matmul ") and "idle" in line


def test_breakdown_rejects_no_steps():
    with pytest.raises(ValueError, match="steps=0"):
        op_breakdown.breakdown(lambda: None, steps=0)
