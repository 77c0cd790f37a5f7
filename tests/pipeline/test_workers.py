"""The local-worker path: a pipeline whose stages run in two TF server processes equals the local model."""

import subprocess
import sys
import textwrap

from tests.helpers.paths import ROOT

SCRIPT = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    from gpipe_tf import workers
    from gpipe_tf.gpipe.pipeline import GPipe
    from gpipe_tf.layers.base_layer import FPropContext
    from gpipe_tf.layers.linear import Linear
    from gpipe_tf.layers.sequential import Sequential

    def layers():
        return [Linear.params().set(input_dim=5, output_dim=5, activation="tanh") for _ in range(4)]

    def grads(net, x):
        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(net.fprop(net.theta, x, FPropContext())))
            return loss, tape.gradient(loss, net.trainable_variables)
        loss, g = step()
        return [loss.numpy()] + [t.numpy() for t in g]

    with workers.LocalWorkers(2) as cluster:
        devices = workers.connect(cluster.spec)
        x = tf.constant(np.random.default_rng(0).normal(size=(8, 5)))
        for schedule in ("unrolled", "fill_drain"):
            pipe = GPipe.params().set(name="net", dtype="float64", layers=layers(), num_stages=2,
                                      num_micro_batches=4, remat="always", devices=devices,
                                      schedule=schedule).instantiate()
            assert {v.device for v in pipe.trainable_variables} == set(devices), pipe.trainable_variables
            seq = Sequential.params().set(name="net", dtype="float64", layers=layers()).instantiate()
            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(grads(pipe, x), grads(seq, x)))
            print(f"{schedule} max_diff={diff:.3e}", flush=True)
""")


def test_two_worker_processes_compute_the_same_gradients():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "max_diff=" in line]
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert float(line.split("max_diff=")[1]) < 1e-10, line


MEMORY_SCRIPT = textwrap.dedent("""
    import tensorflow as tf
    from gpipe_tf import workers

    with workers.LocalWorkers(2) as plain:
        try:
            plain.memory_info(0)
        except RuntimeError as e:
            print("plain:", e)
    with workers.LocalWorkers(2, memory=True) as cluster:
        devices = workers.connect(cluster.spec)
        before = [cluster.memory_info(t)["current"] for t in range(2)]
        with tf.device(devices[1]):
            variable = tf.Variable(tf.zeros([512, 512]))  # 1 MiB on worker 1 only
        after = [cluster.memory_info(t)["current"] for t in range(2)]
        print("variable:", after[0] - before[0], after[1] - before[1])
        cluster.reset_memory_stats(1)

        @tf.function(autograph=False)
        def square():
            with tf.device(devices[1]):
                big = tf.random.stateless_normal([1024, 1024], [1, 2])  # a 4 MiB temporary
                return tf.reduce_sum(tf.matmul(big, big))

        square()
        info = cluster.memory_info(1)
        print("step:", info["peak"] - info["current"])
""")


def test_each_worker_reports_its_own_allocator():
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert "memory=True" in out["plain"], result.stdout
    # The variable is on worker 1 and nowhere else; the step's temporaries (the normal sample and the product, 4
    # MiB each) raised worker 1's peak above what it holds after the step.
    # (Worker 1 may still hold the variable's initial value, 1 MiB more, which the client releases later.)
    on_0, on_1 = (int(n) for n in out["variable"].split())
    assert on_0 == 0 and 2 ** 20 <= on_1 <= 2 * 2 ** 20 + 4096, result.stdout
    assert int(out["step"]) >= 8 * 2 ** 20, result.stdout
