"""The speed plan against the GPipe paper's Table 2: normalized training throughput of AmoebaNet-D (18, 256) and
Transformer-48 on TPUs, K in {2, 4, 8} partitions, M in {1, 4, 32} micro-batches, each normalized to K=2, M=1.

  python -m bench.speed_plan --paper                     # the 18 cells beside the plan's prediction
  python -m bench.speed_plan --paper --accelerator=tpu_v2
  python -m bench.speed_plan --cpu                       # predicted vs measured steps on faithful CPU devices

Each cell is `gpipe_tf.speed.step.predict_step` on the experiment's Params (nothing is built) with GPipe's
schedule (fill-drain), remat 'always', the batch fixed per model (`_MODELS`: the paper gives none for Table 2) and
split into M micro-batches. Transformer-48 is `mt.gpipe_paper.TransformerL_3` with 48 layers; its stages are
balanced by flops (the paper: Transformer layers balance). AmoebaNet-D (18, 256) is
`image.amoebanet.AmoebaNetD_18_208` with 256 filters, partitioned as `--amoeba_balance` says: 'layers' (the same
number of layers per partition) or 'params' (the same parameters per partition); the paper names its partitions
unbalanced and gives neither. error = predicted / paper - 1.

`--cpu` checks the same plan against step times measured on this machine: two faithful devices (single-thread TF
worker processes, `bench.pipeline`'s workload (a) and train step), every schedule at K=2, M in {1, 4, 8}. The CPU
device is measured once: its FLOP/s on the workload's own layers (the one-worker step, K=1, at the same M: its
flops over its time, the predicted memory-bound share (gradient sums, update) taken out; the schedules then differ
only by what the plan simulates), the link (a tensor sent from worker 0 to worker 1 at two sizes: latency and
bandwidth) and the memory bandwidth (an add of two 64 MiB tensors on one worker). error = predicted / measured - 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The paper's Table 2: {model: {M: [K=2, K=4, K=8]}}.
PAPER = {"AmoebaNet-D (18, 256)": {1: [1.0, 1.13, 1.38], 4: [1.07, 1.26, 1.72], 32: [1.21, 1.84, 3.48]},
         "Transformer-48": {1: [1.0, 1.07, 1.3], 4: [1.7, 3.2, 4.8], 32: [1.8, 3.4, 6.3]}}
STAGES = (2, 4, 8)
MICRO_BATCHES = (1, 4, 32)
# (registered experiment, its gin knobs, the batch of every cell)
_MODELS = {"AmoebaNet-D (18, 256)": ("image.amoebanet.AmoebaNetD_18_208", {"filters": 256}, 128),
           "Transformer-48": ("mt.gpipe_paper.TransformerL_3", {"num_layers": 48}, 32)}


def _pipeline(model: str, knobs: dict[str, Any]) -> tuple[Any, Any, str, Any]:
    from gpipe_tf import experiment
    from gpipe_tf.gpipe.pipeline import find_pipelines
    from gpipe_tf.memory.head import task_head

    params, _ = experiment.resolve_params(model, gin_bindings=[f"{model}.{k}={v!r}" for k, v in knobs.items()])
    path, pipe = find_pipelines(params.task)[0]
    return pipe, params.train, path, task_head(params.task, path)


def predict_table(name: str, device: Any, amoeba_balance: str) -> dict[int, list[float]]:
    """{M: [predicted throughput at K=2, 4, 8]} of model `name`, normalized to K=2, M=1."""
    from gpipe_tf.gpipe import partition
    from gpipe_tf.gpipe.batch_shapes import rescaled_micro_batch_shape
    from gpipe_tf.speed.step import predict_step

    model, knobs, batch = _MODELS[name]
    pipe, train, path, head = _pipeline(model, knobs)
    first = [batch] + list(pipe.micro_batch_shape[1:])  # the whole batch as one micro-batch
    out: dict[int, list[float]] = {}
    for m in MICRO_BATCHES:
        row = []
        for k in STAGES:
            p = pipe.copy().set(num_stages=k, num_micro_batches=m, schedule="fill_drain", remat="always",
                                micro_batch_shape=rescaled_micro_batch_shape(first, 1, m))
            if name.startswith("AmoebaNet") and amoeba_balance == "layers":
                p.set(balance=partition.balance_costs([1.0] * len(p.layers), k))  # the same layers per partition
            elif name.startswith("AmoebaNet"):
                p.set(balance=None, balance_by="params")
            else:
                p.set(balance=None, balance_by="flops")
            row.append(predict_step(p, train, device, head, path)["examples_per_second"])
        out[m] = row
    base = out[1][0]
    return {m: [t / base for t in row] for m, row in out.items()}


CPU_SCHEDULES = ("fill_drain", "unrolled", "one_f_one_b", "interleaved", "zero_bubble", "zero_bubble_v")
CPU_MICRO_BATCHES = (1, 4, 8)
CPU_TOLERANCE = 0.15


def _timed(fn: Any, repeats: int = 7) -> float:
    """The median seconds of `fn()` over `repeats` calls after one warm-up."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_link(devices: list[str]) -> tuple[float, float]:
    """(latency seconds, bytes/s) of sending a float32 tensor from worker 0 to worker 1: two sizes, a line."""
    import tensorflow as tf

    sizes, seconds = (2 ** 16, 2 ** 22), []
    for n in sizes:
        with tf.device(devices[0]):
            x = tf.Variable(tf.zeros([n // 4]))

        @tf.function(autograph=False)
        def send(x: Any = x) -> Any:
            with tf.device(devices[1]):
                return tf.reduce_sum(tf.identity(x.read_value()))

        seconds.append(_timed(lambda send=send: send().numpy()))
    bandwidth = (sizes[1] - sizes[0]) / max(1e-9, seconds[1] - seconds[0])
    return max(0.0, seconds[0] - sizes[0] / bandwidth), bandwidth


def measure_memory_bandwidth(device: str) -> float:
    """Bytes/s of an add of two 64 MiB float32 tensors on `device` (read two, write one)."""
    import tensorflow as tf

    n = 2 ** 24
    with tf.device(device):
        a, b = tf.Variable(tf.ones([n])), tf.Variable(tf.ones([n]))

    @tf.function(autograph=False)
    def add() -> Any:
        with tf.device(device):
            return tf.reduce_sum((a + b)[:1])

    return 3 * 4 * n / _timed(lambda: add().numpy())


def _bench_pipe(k: int, m: int, schedule: str) -> Any:
    """The GPipe Params of `bench.pipeline.build_step`'s workload (a) on K stages, M micro-batches."""
    from bench import pipeline as bench_pipeline
    from gpipe_tf.gpipe.pipeline import GPipe

    layers, shape = bench_pipeline.layer_params("transformer")
    return GPipe.params().set(name="net", layers=layers, num_stages=k, num_micro_batches=m, remat="never",
                              schedule=bench_pipeline.schedule_value(schedule),
                              micro_batch_shape=[shape[0] // m] + shape[1:])


def cpu_check(repeats: int) -> list[str]:
    """Measures the CPU device model and every configuration's step on two workers; returns the table's lines."""
    import dataclasses
    import statistics
    import time

    import tensorflow as tf

    from bench import pipeline as bench_pipeline
    from gpipe_tf import workers
    from gpipe_tf.hyperparams import Params
    from gpipe_tf.speed.accelerators import Accelerator
    from gpipe_tf.speed.step import predict_step
    from gpipe_tf.training.optimizers import SGD

    train = Params()
    train.define("optimizer", SGD.params(), "the bench step's update: v -= lr g")
    configs = [(1, m, "unrolled") for m in CPU_MICRO_BATCHES]
    configs += [(2, m, s) for m in CPU_MICRO_BATCHES for s in CPU_SCHEDULES
                if not (s == "interleaved" and m % 2)]  # interleaved takes M a multiple of K
    lines = []
    with workers.LocalWorkers(2) as cluster:
        devices = workers.connect(cluster.spec)
        latency, link = measure_link(devices)
        memory_bandwidth = measure_memory_bandwidth(devices[0])
        steps = {}
        for k, m, schedule in configs:
            step, x, _ = bench_pipeline.build_step("transformer", k, m, "never", devices, schedule)
            with tf.device(devices[k - 1]):
                step(x).numpy()
            steps[(k, m, schedule)] = (step, x)
            print(f"# built K={k} M={m} {schedule}", file=sys.stderr)
        times: dict[tuple, list[float]] = {c: [] for c in configs}
        for repeat in range(repeats):
            for config, (step, x) in steps.items():
                with tf.device(devices[config[0] - 1]):
                    for _ in range(2):
                        start = time.perf_counter()
                        step(x).numpy()
                        times[config].append(time.perf_counter() - start)
            print(f"# repeat {repeat + 1}/{repeats} done", file=sys.stderr)
    measured = {c: statistics.median(t) for c, t in times.items()}
    device = Accelerator("cpu worker", {"float32": 1.0}, 2 ** 34, memory_bandwidth, link, latency, efficiency=1.0)
    lines.append(f"CPU device: link {link / 1e9:.2f} GB/s + {latency * 1e6:.0f} us, memory "
                 f"{memory_bandwidth / 1e9:.1f} GB/s, FLOP/s per M from the one-worker step (below)")
    lines.append(f"{'K':>2} {'M':>2}  {'schedule':<14} {'measured':>10} {'predicted':>10} {'error':>8}")
    within = 0
    for config in configs:
        k, m, schedule = config
        # At 1 FLOP/s the one-worker step's compute takes step_flops seconds; the rest of its predicted time is
        # memory-bound (gradient sums, update), which the rate must not absorb: the K=2 prediction adds it again.
        one = predict_step(_bench_pipe(1, m, "unrolled"), train, device)
        memory_bound = one["step_seconds"] - one["step_flops"]
        rate = one["step_flops"] / max(1e-9, measured[(1, m, "unrolled")] - memory_bound)
        if k == 1:
            lines.append(f"{k:>2} {m:>2}  {schedule:<14} {measured[config]:>9.4f}s {'':>10} {'':>8}  "
                         f"the device: {rate / 1e9:.1f} GFLOP/s")
            continue
        at_rate = dataclasses.replace(device, peak_flops={"float32": rate})
        predicted = predict_step(_bench_pipe(k, m, schedule), train, at_rate)["step_seconds"]
        error = predicted / measured[config] - 1
        within += abs(error) <= CPU_TOLERANCE
        lines.append(f"{k:>2} {m:>2}  {schedule:<14} {measured[config]:>9.4f}s {predicted:>9.4f}s {error:>+8.1%}")
    count = len(configs) - len(CPU_MICRO_BATCHES)
    lines.append(f"within {CPU_TOLERANCE:.0%}: {within} of {count} configurations")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Prints Table 2 beside the prediction; the exit status is 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paper", action="store_true", help="Table 2 of the GPipe paper beside the prediction")
    parser.add_argument("--cpu", action="store_true", help="predicted vs measured steps on two faithful CPU devices")
    parser.add_argument("--repeats", type=int, default=5, help="--cpu: rounds over all configurations")
    parser.add_argument("--accelerator", default="tpu_v3", help="the device preset (gpipe_tf.speed.accelerators)")
    parser.add_argument("--amoeba_balance", choices=("layers", "params"), default="layers",
                        help="how AmoebaNet-D's partitions are cut")
    args = parser.parse_args(argv)
    if not (args.paper or args.cpu):
        parser.error("give --paper, --cpu or both")
    print(f"python -m bench.speed_plan {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.cpu:
        print("\n".join(cpu_check(args.repeats)), flush=True)
    if not args.paper:
        return 0
    from gpipe_tf.speed.accelerators import accelerator

    device = accelerator(args.accelerator)
    print(f"device {device.describe()}; fill-drain, remat always; AmoebaNet partitions by {args.amoeba_balance}")
    print(f"{'model':<22} {'M':>3}  " + "  ".join(f"{'K=' + str(k) + ' paper/plan/error':>24}" for k in STAGES))
    for name in PAPER:
        table = predict_table(name, device, args.amoeba_balance)
        for m in MICRO_BATCHES:
            cells = [f"{p:>6.2f} {q:>6.2f} {q / p - 1:>+9.1%}" for p, q in zip(PAPER[name][m], table[m])]
            print(f"{name:<22} {m:>3}  " + "  ".join(f"{c:>24}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
