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
