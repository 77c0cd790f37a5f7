"""D x K benchmark: throughput of D data-parallel replicas of a K-stage pipeline on 4 logical CPU devices.

Runs the trainer's own train step (Learner: replicas, tf.distribute all-reduce, optimizer update) on workload (a)
of bench/pipeline.py (8 Transformer encoder layers, d_model 512, batch 32, loss = mean of squared outputs) for
(D, K) = (1, 1), (2, 1), (1, 2), (2, 2), alternating the configurations each round, and reports examples/sec as
a ratio to D=1, K=1 (medians over rounds). Logical CPUs share this process's thread pool, so on a 2-core machine
the ratios show the cost of the replication and reduction machinery rather than a speed-up; on D*K real devices
the same command measures scaling.

  python -m bench.data_parallel [--repeats 3] [--steps 2]      # also: python -m bench.pipeline --dxk
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CONFIGS = ((1, 1), (2, 1), (1, 2), (2, 2))
NUM_DEVICES = 4


def build(num_replicas: int, num_stages: int, micro_batches: int) -> tuple[Any, Any]:
    """The Learner of workload (a) with D replicas of a K-stage pipeline, and its input batch."""
    import tensorflow as tf

    from bench.pipeline import TRANSFORMER, layer_params
    from gpipe_tf.gpipe import placement
    from gpipe_tf.gpipe.pipeline import GPipe
    from gpipe_tf.layers.base_layer import FPropContext
    from gpipe_tf.tasks.base_task import BaseTask, Metrics
    from gpipe_tf.training import learner, optimizers, replicas
    from gpipe_tf.training.replicas import replica_home_devices

    class SquaredOutput(BaseTask):
        """Workload (a): the pipeline's mean squared output as the loss."""

        def __init__(self, params: Any, parent_path: str = "") -> None:
            super().__init__(params, parent_path)
            layers, _ = layer_params("transformer")
            self.create_child("network", GPipe.params().set(layers=layers, num_stages=num_stages,
                                                            num_micro_batches=micro_batches, device_kind="cpu"))

        def compute_loss(self, theta: Mapping[str, Any], batch: Mapping[str, tf.Tensor],
                         ctx: FPropContext) -> tuple[tf.Tensor, Metrics]:
            out = self.children["network"].fprop(theta["network"], batch["x"], ctx)
            loss = tf.reduce_mean(tf.square(out))
            return loss, {"loss": (loss, tf.constant(1.0))}

    layout = replicas.ReplicaLayout(local_replicas=num_replicas)
    with placement.replicas(num_replicas):
        task = SquaredOutput.params().set(name="task").instantiate()
    layout.attach_devices(replica_home_devices(task, num_replicas))
    tp = learner.training_params().set(learning_rate=1e-6, optimizer=optimizers.SGD.params())
    w = TRANSFORMER
    batch = {"x": tf.random.stateless_normal([w["batch"], w["seq"], w["model_dim"]], [1, 2])}
    return learner.Learner(task, tp, layout), batch


def main() -> None:
    """Splits the CPU, times every configuration in alternating rounds, prints JSON lines and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all configurations")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round")
    parser.add_argument("--micro_batches", type=int, default=4, help="M of the K=2 pipelines")
    args = parser.parse_args()

    from bench.pipeline import TRANSFORMER
    from gpipe_tf import devices

    devices.split_cpu(NUM_DEVICES)
    steps: dict[tuple[int, int], Any] = {}
    for d, k in CONFIGS:
        start = time.perf_counter()
        step, batch = build(d, k, args.micro_batches if k > 1 else 1)
        step.train_step(batch)["loss"].numpy()
        steps[(d, k)] = (step, batch, time.perf_counter() - start)
    times: dict[tuple[int, int], list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            step, batch, _ = steps[config]
            start = time.perf_counter()
            for _ in range(args.steps):
                step.train_step(batch)["loss"].numpy()
            times[config].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times[(1, 1)])
    for (d, k), values in times.items():
        step_time = statistics.median(values)
        print(json.dumps(dict(workload="transformer", mode="dxk", d=d, k=k,
                              m=args.micro_batches if k > 1 else 1, devices=NUM_DEVICES,
                              step_time_s=round(step_time, 4),
                              examples_per_sec=round(TRANSFORMER["batch"] / step_time, 2),
                              throughput_ratio=round(base / step_time, 3),
                              compile_s=round(steps[(d, k)][2], 2))), flush=True)
    print("throughput vs D=1,K=1 (4 logical CPU devices, one thread pool): " + ", ".join(
        f"D={d},K={k}: {base / statistics.median(times[(d, k)]):.2f}" for d, k in CONFIGS[1:]))


if __name__ == "__main__":
    main()
