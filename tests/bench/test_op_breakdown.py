"""bench.op_breakdown: op types fall into the documented categories, and a profiled step is attributed to them."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from bench import op_breakdown
from tests.helpers.paths import ROOT


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

    @tf.function(autograph=False)
    def matmuls() -> tf.Tensor:
        x = a
        for _ in range(8):
            x = tf.matmul(x, a) / 16.0
        return tf.reduce_sum(x)

    @tf.function(autograph=False)
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


TRACE_SCRIPT = textwrap.dedent("""
    import json
    import tensorflow as tf
    from bench import op_breakdown
    from gpipe_tf import workers

    with workers.LocalWorkers(2, profiler=True) as cluster:
        devices = workers.connect(cluster.spec)
        a = tf.random.stateless_normal([128, 128], [1, 2])

        @tf.function(autograph=False)
        def step():
            with tf.device(devices[0]):
                x = a
                for _ in range(4):
                    x = tf.matmul(x, a) / 16.0
            with tf.device(devices[1]):
                y = x
                for _ in range(4):
                    y = tf.nn.softmax(y + 1.0, axis=-1)
                return tf.reduce_sum(y)

        step().numpy()
        print(json.dumps(op_breakdown.trace_workers(cluster.profiler_addresses, lambda: step().numpy(), 3000)))
""")


def test_trace_workers_attributes_each_workers_ops_to_that_worker():
    out = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    assert first["matmul"] > 0 and first["attention"] == 0
    assert second["attention"] > 0 and second["matmul"] == 0
    for shares in (first, second):
        assert set(shares) == set(op_breakdown.CATEGORIES)
        assert abs(sum(shares.values()) - 1.0) < 1e-6  # busy categories plus idle fill the traced span
