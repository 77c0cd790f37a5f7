"""Pipeline benchmark: efficiency, remat cost, memory and compile cost of GPipe on this machine.

Speed is measured on faithful devices: K single-thread TF worker processes on 127.0.0.1 that this script starts
and stops, with stage k on worker k and the one-device baseline on worker 0 (logical CPUs in one process share
one thread pool and say nothing about a schedule). Memory is measured in a separate process on the local CPU
with `tf.config.experimental.get_memory_info` (all logical CPUs' bytes together), and per device in others, on 4
workers that each read their own allocator (`device_memory_worker`; each device's median over `--memory-processes`
fresh processes).

Prints one JSON line per configuration, then a table. Figures are medians over repeats that alternate the
configurations, so a slow moment of the machine hits all of them alike; compare ratios, not absolute times.

  python -m bench.pipeline --quick        # reduced set, under 10 minutes on 2 cores
  python -m bench.pipeline                # everything
  python -m bench.pipeline --skip-speed   # memory of workload (b) only: in one process, and per device
  python -m bench.pipeline --breakdown    # where the one-worker step's time goes, by op category, only
  python -m bench.pipeline --timeline     # measured vs predicted timeline of each schedule (PNG, text, JSON)
  python -m bench.pipeline --repredict bench_timelines  # those measurements beside the current prediction
  python -m bench.pipeline --peer         # every schedule at K=2, M=8 and the one-worker step: torch's peer set
  python -m bench.pipeline --xla          # the same with jit_compile on and off, side by side
  python -m bench.pipeline --dxk          # D x K data parallelism on 4 logical CPUs (bench/data_parallel.py)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import op_breakdown, per_device
from bench.cli import positive_count

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Memory figures need TensorFlow's BFC allocator on CPU (otherwise get_memory_info raises on CPUs where oneDNN is
# off, e.g. without AVX-512); it must be chosen before TensorFlow starts.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")
# oneDNN kernels on every CPU, as the trainer chooses them (gpipe_tf/trainer_main.py says why); workers inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

TRANSFORMER = dict(layers=8, model_dim=512, heads=8, ffn=2048, seq=64, batch=32)
# Workload (b), activation-dominated as in the GPipe paper's O(N + L/K x N/M) argument: per-layer activations
# 32 MiB, weights 4 MiB.
MLP = dict(layers=32, width=1024, batch=8192)
# Weight-heavy: 16 MiB of weights per layer, tiny activations; what a schedule that moved weights or their
# gradient sums between devices would pay for.
HEAVY = dict(layers=16, width=2048, batch=16)
# A small stack for a quick look at the measured timelines (`--timeline --workload tiny`, and the tests).
TINY = dict(layers=8, width=256, batch=64)


def layer_params(workload: str) -> tuple[list[Any], list[int]]:
    """The workload's layer Params and the shape of its input batch: 'transformer', 'mlp' or 'heavy'."""
    if workload == "transformer":
        from gpipe_tf.layers.transformer import TransformerEncoderLayer
        w = TRANSFORMER
        layers = [TransformerEncoderLayer.params().set(model_dim=w["model_dim"], num_heads=w["heads"],
                                                       hidden_dim=w["ffn"]) for _ in range(w["layers"])]
        return layers, [w["batch"], w["seq"], w["model_dim"]]
    from gpipe_tf.layers.linear import Linear
    w = {"heavy": HEAVY, "tiny": TINY}.get(workload, MLP)
    layers = [Linear.params().set(input_dim=w["width"], output_dim=w["width"], activation="relu")
              for _ in range(w["layers"])]
    return layers, [w["batch"], w["width"]]


def build_step(workload: str, k: int, m: int, remat: str, devices: list[str], schedule: str = "unrolled"
               ) -> tuple[Callable, Any, float]:
    """A tf.function train step (loss = mean of squared outputs, computed in the pipeline's last stage per
    micro-batch; SGD update) and its useful flops."""
    import tensorflow as tf

    from gpipe_tf.gpipe.pipeline import GPipe
    from gpipe_tf.gpipe.schedule_base import PipelineLoss
    from gpipe_tf.layers.base_layer import FPropContext

    layers, shape = layer_params(workload)
    pipe = GPipe.params().set(name="net", layers=layers, num_stages=k, num_micro_batches=m, remat=remat,
                              devices=devices[:k], schedule=schedule_value(schedule),
                              jit_compile=schedule.endswith(XLA)).instantiate()
    variables = pipe.trainable_variables
    ctx = FPropContext(training=True)
    size = 1.0
    for d in shape:
        size *= d
    loss = PipelineLoss(fn=lambda head, out, targets, micro_ctx: {"loss": tf.reduce_sum(tf.square(out))},
                        head_weights=(), targets={}, gradient_seed=tf.constant(1.0 / size))

    @tf.function(autograph=False)
    def step(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            mean_square = pipe.fprop_with_loss(pipe.theta, x, loss, ctx)["loss"] / size
        grads = tape.gradient(mean_square, variables)
        for v, g in zip(variables, grads):
            with tf.device(v.device):
                v.assign_sub(1e-6 * g)
        return mean_square

    with tf.device(devices[0]):
        x = tf.random.stateless_normal(shape, [1, 2])
    forward = GPipe.flops(pipe.p, tf.TensorSpec(shape, tf.float32))
    return step, x, 3.0 * forward


def matmul_flops_per_sec(device: str) -> float:
    """Single-core matmul throughput of one worker (median of 5)."""
    import tensorflow as tf

    n, chain = 1024, 8
    with tf.device(device):
        a = tf.random.normal([n, n]) / n

    @tf.function(autograph=False)
    def f(x: tf.Tensor) -> tf.Tensor:
        with tf.device(device):
            for _ in range(chain):
                x = tf.matmul(x, a)
            return tf.reduce_sum(x)

    f(a).numpy()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        f(a).numpy()
        times.append(time.perf_counter() - start)
    return chain * 2.0 * n ** 3 / statistics.median(times)


# Pipelined configurations whose workers are traced after timing: where each worker's time goes (transfer, idle).
TRACED = [("transformer", 2, 8, "never", "unrolled"), ("transformer", 2, 8, "never", "fill_drain")]


def speed(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Step times on faithful devices (TF worker processes), the derived efficiencies, and one line per traced
    configuration and worker: its time by op category (`bench/op_breakdown.py`)."""
    import tensorflow as tf

    from gpipe_tf import workers

    schedules = ("unrolled", "fill_drain")
    if args.xla:
        # Every schedule at K=2, M=8 and the one-worker step, with TensorFlow's kernels and with XLA stage cells,
        # alternated in one run.
        plain = [("transformer", 1, 8, "never", "unrolled")]
        plain += [("transformer", 2, 8, "never", sch) for sch in PEER_SCHEDULES if not sch.endswith(BATCHED_W)]
        configs = [c for config in plain for c in (config, config[:4] + (config[4] + XLA,))]
        compile_ms = []
    elif args.peer:
        # The set a PyTorch peer on workload (a) measures (torch.distributed.pipelining's GPipe, 1F1B,
        # Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble): the one-worker step, each schedule at K=2, M=8; and
        # the one-worker step at M=8, which separates the schedule from the cost of M smaller matmuls.
        configs = [("transformer", 1, m, "never", "unrolled") for m in (1, 8)]
        # The one-worker M=8 step with batched W: half of it bounds any K=2, M=8 step of these kernels from below.
        configs += [("transformer", 1, 8, "never", "fill_drain" + BATCHED_W)]
        configs += [("transformer", 2, 8, "never", sch) for sch in PEER_SCHEDULES]
        # GPipe with rematerialization, beside torch's GPipe with every layer checkpointed (`--remat always`).
        configs += [("transformer", 2, 8, "always", "fill_drain")]
        compile_ms = []
    elif args.compare:
        configs = [("transformer", 2, 8, r, sch) for r in ("never", "always") for sch in schedules]
        compile_ms = []
    elif args.quick:
        configs = [("transformer", 1, m, r, "unrolled") for m in (1, 8) for r in ("never", "always")]
        configs += [("transformer", 2, 8, r, sch) for r in ("never", "always") for sch in schedules]
        compile_ms = [4, 32]
    else:
        configs = [("transformer", k, m, r, "unrolled") for r in ("never", "always") for k in (1, 2)
                   for m in (1, 2, 4, 8)]
        configs += [("transformer", 2, m, r, "fill_drain") for r in ("never", "always") for m in (1, 2, 4, 8)]
        compile_ms = [4, 8, 16, 32]
    if not (args.peer or args.xla):
        configs += [("heavy", 2, 8, "never", sch) for sch in schedules]
    if not (args.peer or args.xla):
        # The zero-bubble schedules on the weight-heavy workload too, by default (batch_weight_gradients='auto')
        # and with every matmul weight batched.
        configs += [("heavy", 2, 8, "never", sch) for sch in HEAVY_SCHEDULES]
    if not (args.compare or args.peer or args.xla):
        # The schedules beyond fill-drain: 1F1B, ZeroBubble (ZB-H1) and ZeroBubbleV at K=2, M=8, interleaved v=2
        # at K=2, M=4.
        configs += [("transformer", 2, 8, "never", sch) for sch in ("one_f_one_b", "zero_bubble", "zero_bubble_v")]
        configs += [("transformer", 2, 4, "never", "fill_drain"), ("transformer", 2, 4, "never", "interleaved")]
    rows = []
    traced_lines = []
    with workers.LocalWorkers(2, profiler=True) as cluster:
        devices = workers.connect(cluster.spec)
        peak = matmul_flops_per_sec(devices[0])
        print(f"# single-core matmul: {peak / 1e9:.1f} GFLOP/s", file=sys.stderr)
        steps: dict[tuple, Any] = {}
        compile_s: dict[tuple, float] = {}
        for config in configs:
            workload, k, m, remat, schedule = config
            step, x, flops = build_step(workload, k, m, remat, devices, schedule)
            start = time.perf_counter()
            with tf.device(devices[k - 1]):
                step(x).numpy()
            compile_s[config] = time.perf_counter() - start
            steps[config] = (step, x, flops)
            print(f"# built {config} in {compile_s[config]:.1f} s", file=sys.stderr)
        times: dict[tuple, list[float]] = {c: [] for c in configs}
        for repeat in range(args.repeats):
            for config, (step, x, _) in steps.items():
                with tf.device(devices[config[1] - 1]):
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        step(x).numpy()
                        times[config].append(time.perf_counter() - start)
            print(f"# repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
        median = {c: statistics.median(t) for c, t in times.items()}
        base = median.get(("transformer", 1, 1, "never", "unrolled"))
        for (workload, k, m, remat, schedule), t in median.items():
            same_m = median.get((workload, 1, m, remat, "unrolled"))
            no_remat = median.get((workload, k, m, "never", schedule))
            rows.append(dict(
                workload=workload, schedule=schedule, k=k, m=m, remat=remat, step_time_s=round(t, 4),
                efficiency=round(base / (k * t), 3) if workload == "transformer" and base else None,
                vs_one_worker=round(t / base, 3) if workload == "transformer" and base else None,
                efficiency_same_m=round(same_m / (k * t), 3) if same_m else None,
                efficiency_bound=round(bound(k, m, schedule), 3),
                remat_cost=round(t / no_remat, 3) if no_remat else None,
                peak_memory_mb=None, compile_s=round(compile_s[(workload, k, m, remat, schedule)], 2),
                flops_fraction=round(steps[(workload, k, m, remat, schedule)][2] / t / (k * peak), 3)))
        for config in [] if args.peer or args.xla else [c for c in TRACED if c in steps]:
            step, x, _ = steps[config]
            with tf.device(devices[config[1] - 1]):
                shares = op_breakdown.trace_workers(cluster.profiler_addresses,
                                                    lambda step=step, x=x: step(x).numpy(), 6000)
            for worker, share in enumerate(shares):
                traced_lines.append(f"{config[0]} {config[4]} K={config[1]} M={config[2]} remat={config[3]}, worker "
                                    f"{worker}: {op_breakdown.format_breakdown(share)}")
            print(f"# traced {config}", file=sys.stderr)
        # The unrolled schedule's trace grows with M (minutes at M=32), so --quick measures fill_drain only.
        for schedule in () if args.peer or args.xla else ("fill_drain",) if args.quick or args.compare else (
                "fill_drain", "unrolled"):
            for m in compile_ms:
                step, x, _ = build_step("transformer", 2, m, "never", devices, schedule)
                start = time.perf_counter()
                with tf.device(devices[1]):
                    step(x).numpy()
                rows.append(dict(workload="transformer", schedule=schedule, k=2, m=m, remat="never",
                                 step_time_s=None, efficiency=None, vs_one_worker=None, efficiency_same_m=None,
                                 efficiency_bound=round(bound(2, m, schedule), 3), remat_cost=None,
                                 peak_memory_mb=None, compile_s=round(time.perf_counter() - start, 2),
                                 flops_fraction=None))
                print(f"# compiled schedule={schedule} M={m}", file=sys.stderr)
    return rows, traced_lines


# A schedule name with this suffix stands for the schedule with batch_weight_gradients=True (W batched over the
# micro-batches after each stage's last backward), e.g. "zero_bubble+batched_w".
BATCHED_W = "+batched_w"
# A schedule name with this suffix (last) runs the pipeline with jit_compile=True: XLA stage cells.
XLA = "+xla"


def schedule_value(schedule: str) -> Any:
    """What GPipe's `schedule` field gets for a benchmark's schedule name (without its XLA suffix): the short name
    itself, or for a name ending in BATCHED_W, the schedule's Params with batch_weight_gradients=True."""
    from gpipe_tf.gpipe import schedules

    schedule = schedule.removesuffix(XLA)
    if schedule.endswith(BATCHED_W):
        return schedules.schedule_params(schedule[:-len(BATCHED_W)]).set(batch_weight_gradients=True)
    return schedule


def step_order(schedule: str, k: int) -> Any:
    """The order data (`orders.ScheduleOrder`) of the schedule a benchmark's name stands for (`schedule_value`)
    on K devices."""
    from gpipe_tf.gpipe import schedules

    return schedules.step_order(schedule_value(schedule), k)


def bound(k: int, m: int, schedule: str) -> float:
    """The efficiency bound 1 - bubble of the schedule's order: vM / (vM + K - 1)."""
    return 1.0 - step_order(schedule, k).bubble_bound(m)


def predicted_activation_mb(k: int, m: int, remat: str) -> float:
    """GPipe's activation memory of workload (b) (the paper's O(N + L/K x N/M)): with remat each stage keeps
    its M stage inputs plus one micro-batch's layer outputs while it recomputes; without, every layer output of
    every micro-batch."""
    w = MLP
    micro_mb = w["batch"] // m * w["width"] * 4 / 2 ** 20  # one layer output of one micro-batch
    per_stage = w["layers"] // k
    if remat == "always":
        return k * (m + per_stage) * micro_mb
    return k * m * per_stage * micro_mb


def memory_worker(quick: bool) -> None:
    """Runs in its own process: peak memory of one step of workload (b), K=2 on 2 logical CPUs, JSON lines."""
    import tensorflow as tf

    from gpipe_tf import devices as devices_lib

    devices = devices_lib.split_cpu(4)
    # All M even when quick: one process, seconds each, and "non-increasing in M" needs more than one point.
    configs = [(2, 1, "never", "fill_drain")] + [(2, m, "always", "fill_drain") for m in (2, 4, 8)]
    # 1F1B and ZeroBubble against fill-drain where fill-drain keeps the most: K=4, M=16, no remat.
    configs += [(4, 16, "never", schedule)
                for schedule in ("fill_drain", "one_f_one_b", "zero_bubble", "zero_bubble_v")]
    for k, m, remat, schedule in configs:
        step, x, _ = build_step("mlp", k, m, remat, devices, schedule)
        step(x).numpy()
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step(x).numpy()
        peak = (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2 ** 20
        print(json.dumps(dict(workload="mlp", schedule=schedule, k=k, m=m, remat=remat, step_time_s=None,
                              efficiency=None, efficiency_same_m=None, efficiency_bound=None, remat_cost=None,
                              peak_memory_mb=round(peak, 1),
                              predicted_activation_mb=round(predicted_activation_mb(k, m, remat), 1),
                              compile_s=None, flops_fraction=None)), flush=True)


# The schedules whose memory per device is compared at K=4, M=16 without remat (`device_memory_worker`).
DEVICE_MEMORY_SCHEDULES = ("one_f_one_b", "zero_bubble", "zero_bubble_v")


def device_memory_worker(schedule: str, steps: int) -> None:
    """Runs in its own process (a client joins one cluster): each device's peak memory in steps of workload (b) at
    K=4, M=16 without remat under `schedule`, on faithful devices (4 worker processes, stage k on worker k, each
    reading its own allocator); one JSON line.

    A device's peak is all it holds at its busiest: its stages' weights, the batch (on the first device), the
    stashes and the step's transients; the most over `steps` steps after a warm-up step (a step's peak moves with
    the order a worker's executor picks), above what the worker held before the step was built. The process-wide
    figure of `memory_worker` adds up every device instead, which differs where a schedule spreads its stashes
    differently: 1F1B holds K - k micro-batches' stashes on stage k, K(K+1)/2 in all, while ZB-V's V gives every
    device the first device's K (K^2 in all), the same per device but more in sum.
    """
    import tensorflow as tf

    from gpipe_tf import workers

    with workers.LocalWorkers(4, memory=True) as cluster:
        devices = workers.connect(cluster.spec)
        before = [cluster.memory_info(t)["current"] for t in range(4)]
        step, x, _ = build_step("mlp", 4, 16, "never", devices, schedule)
        with tf.device(devices[-1]):
            step(x).numpy()
        peaks = [0] * 4
        for _ in range(steps):
            for t in range(4):
                cluster.reset_memory_stats(t)
            with tf.device(devices[-1]):
                step(x).numpy()
            peaks = [max(p, cluster.memory_info(t)["peak"] - before[t]) for t, p in enumerate(peaks)]
    print(json.dumps(dict(workload="mlp", schedule=schedule, k=4, m=16, remat="never",
                          device_peak_memory_mb=[round(p / 2 ** 20, 1) for p in peaks])), flush=True)


def device_memory_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The lines of `median_device_row`'s rows: each schedule's peak per device, and its largest device against
    1F1B's largest."""
    peaks = {r["schedule"]: r["device_peak_memory_mb"] for r in rows}
    out = [f"peak memory per device K=4 M=16 no remat {r['schedule']}: "
           f"{' / '.join(f'{v:.1f}' for v in r['device_peak_memory_mb'])} MiB"
           f"{f' (medians of {n} processes)' if (n := len(r['device_peak_memory_runs_mb'])) > 1 else ''}"
           for r in rows]
    base = peaks.get("one_f_one_b")
    for schedule, p in peaks.items():
        if base and schedule != "one_f_one_b":
            out.append(f"peak memory of the largest device K=4 M=16 no remat {schedule} / one_f_one_b: "
                       f"{max(p) / max(base):.2f} ({max(p):.1f} / {max(base):.1f} MiB)")
    return out


TIMELINE_SCHEDULES = ("fill_drain", "one_f_one_b", "interleaved", "zero_bubble", "zero_bubble_v")
# The schedules --peer runs at K=2, M=8, to set beside torch.distributed.pipelining's on the same workload.
PEER_SCHEDULES = ("fill_drain", "unrolled", "one_f_one_b", "interleaved", "zero_bubble", "zero_bubble_v",
                  "fill_drain" + BATCHED_W, "zero_bubble" + BATCHED_W, "zero_bubble_v" + BATCHED_W)
# The schedules beyond Unrolled and FillDrain that every speed run times on the weight-heavy workload.
HEAVY_SCHEDULES = ("zero_bubble", "zero_bubble_v", "fill_drain" + BATCHED_W, "zero_bubble" + BATCHED_W,
                   "zero_bubble_v" + BATCHED_W)
CLOSE_POINTS = 5.0  # prediction and median measurement agree within this many percentage points


def _timeline_schedules(text: str) -> list[str]:
    """The --schedules flag: names from TIMELINE_SCHEDULES, comma-separated."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name not in TIMELINE_SCHEDULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--schedules={text!r} is invalid: give one or more of "
                                         f"{','.join(TIMELINE_SCHEDULES)}, comma-separated")
    return names


def timelines(args: argparse.Namespace) -> list[str]:
    """Profiles `args.traced_steps` steps of each schedule of `args.schedules` (K=2, M in `args.micro_batches`, no
    remat) on faithful devices and writes the median step's measured timeline beside its prediction
    (`bench/measured_timeline.py`) as <out>/timeline_<schedule>_m<M>.png, .txt and .json (the measured cells and
    their ops, which `repredict` reads); returns one line per configuration with the median measured bubble, the
    predicted one (from the median step's measured costs), their distance in points and the bound."""
    import tensorflow as tf

    from bench import measured_timeline
    from gpipe_tf import workers

    os.makedirs(args.out, exist_ok=True)
    lines = []
    with workers.LocalWorkers(2, profiler=True) as cluster:
        devices = workers.connect(cluster.spec)
        for schedule, k, m in [(s, 2, m) for s in args.schedules for m in args.micro_batches]:
            step, x, _ = build_step(args.workload, k, m, "never", devices, schedule)
            with tf.device(devices[k - 1]):
                step(x).numpy()
                times = []
                for _ in range(3):
                    start = time.perf_counter()
                    step(x).numpy()
                    times.append(time.perf_counter() - start)
                seconds = statistics.median(times)
                order = step_order(schedule, k)
                traced = sorted((measured_timeline.trace_step(cluster.profiler_addresses,
                                                              lambda step=step, x=x: step(x).numpy(), seconds, m,
                                                              order) for _ in range(args.traced_steps)),
                                key=lambda t: t.bubble_fraction)
            measured = traced[len(traced) // 2]
            base = os.path.join(args.out, f"timeline_{schedule}_m{m}")
            with open(base + ".json", "w", encoding="utf-8") as f:
                json.dump(measured_timeline.to_json(measured, schedule), f)
            each = "/".join(f"{t.bubble_fraction:.1%}" for t in traced)
            lines.append(_timeline_line(args.workload, schedule, measured, base, f"median of {each}; ",
                                        f"; step {seconds:.3f} s"))
            print(f"# {lines[-1]}", file=sys.stderr)
    return lines


def repredict(directory: str, workload: str) -> list[str]:
    """The predictions for the measured timelines a `--timeline` run saved in `directory` (timeline_*.json), made
    again with the current `timeline.predict`, and the pictures drawn again beside them; one line per file, as
    `timelines` prints (without the three steps' bubbles and the step time, which the files do not hold).

    Raises:
      FileNotFoundError: `directory` holds no timeline_*.json.
    """
    from bench import measured_timeline

    paths = sorted(glob.glob(os.path.join(directory, "timeline_*.json")))
    if not paths:
        raise FileNotFoundError(f"--repredict={directory!r} holds no timeline_*.json: give the --out directory of "
                                "a `python -m bench.pipeline --timeline` run")
    saved = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("schedule") not in TIMELINE_SCHEDULES:
            raise ValueError(f"{path} holds schedule={data.get('schedule')!r}: --repredict reads the files of "
                             f"--timeline, whose schedules are {', '.join(TIMELINE_SCHEDULES)}")
        saved.append((TIMELINE_SCHEDULES.index(data["schedule"]), data["m"], path, data))
    lines = []
    for _, _, path, data in sorted(saved):
        measured = measured_timeline.from_json(data, step_order(data["schedule"], data["k"]))
        lines.append(_timeline_line(workload, data["schedule"], measured, path[:-len(".json")], "saved step; "))
    return lines


def _timeline_line(workload: str, schedule: str, measured: Any, base: str, steps: str, tail: str = "") -> str:
    """Draws `measured` beside its prediction to <base>.png and .txt and returns the line that compares them."""
    from bench import measured_timeline
    from gpipe_tf.training import timeline_pictures

    predicted = measured_timeline.predicted_from(measured)
    with open(base + ".png", "wb") as f:
        f.write(timeline_pictures.render_comparison_png(predicted, measured))
    with open(base + ".txt", "w", encoding="utf-8") as f:
        f.write(timeline_pictures.render_comparison_text(predicted, measured) + "\n")
    points = 100 * abs(measured.bubble_fraction - predicted.bubble_fraction)
    v, k, m = measured.virtual_stages, measured.num_stages, measured.num_micro_batches
    return (f"{workload} {schedule}{f' v={v}' if v > 1 else ''} K={k} M={m}: measured bubble "
            f"{measured.bubble_fraction:.1%} ({steps}idle incl. transfers {measured.idle_fraction:.1%}) vs predicted "
            f"{predicted.bubble_fraction:.1%}: {points:.1f} points apart "
            f"({'within' if points <= CLOSE_POINTS else 'NOT within'} {CLOSE_POINTS:.0f}); bound "
            f"{measured.ideal_bubble_fraction():.1%}{tail}; {base}.png")


def breakdown_worker(steps: int) -> None:
    """Runs in its own process: the one-worker step of workload (a) (K=1, M=1, no remat) on one thread, as on a
    single-thread worker, profiled; prints seconds per step by op category as one JSON line."""
    import tensorflow as tf

    from bench import op_breakdown

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    device = "/device:CPU:0"
    step, x, _ = build_step("transformer", 1, 1, "never", [device], "unrolled")
    step(x).numpy()
    step(x).numpy()
    seconds = op_breakdown.breakdown(lambda: step(x).numpy(), steps)
    print(json.dumps(dict(breakdown={c: round(t, 4) for c, t in seconds.items()})), flush=True)


def _run_worker(flag: str, *extra: str) -> list[dict[str, Any]]:
    """Runs this module with `flag` in a fresh process; its JSON lines."""
    cmd = [sys.executable, "-m", "bench.pipeline", flag, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def breakdown(args: argparse.Namespace) -> dict[str, float]:
    """The one-worker step's seconds by op category, from a fresh single-thread process."""
    return _run_worker("--breakdown-worker", "--steps", str(max(args.steps, 2)))[0]["breakdown"]


def breakdown_line(parts: dict[str, float]) -> str:
    """The closing line of the one-worker step's breakdown: its seconds and each category's share."""
    return (f"one-worker step (workload (a), K=1, M=1, no remat, one thread, {sum(parts.values()):.3f} s): "
            f"{op_breakdown.format_breakdown(parts)}")


def memory(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Memory figures from fresh processes (their allocator state is not shared with the speed runs): the
    process-wide rows of `memory_worker`, and the per-device rows of `device_memory_worker`."""
    process_rows = _run_worker("--memory-worker", *(["--quick"] if args.quick else []))
    runs: dict[str, list[list[float]]] = {schedule: [] for schedule in DEVICE_MEMORY_SCHEDULES}
    for _ in range(args.memory_processes):  # rounds over the schedules, as the speed repeats alternate
        for schedule in DEVICE_MEMORY_SCHEDULES:
            row, = _run_worker("--device-memory-worker", schedule, "--steps", str(max(args.steps, 3)))
            runs[schedule].append(row["device_peak_memory_mb"])
    return process_rows, [median_device_row(schedule, peaks) for schedule, peaks in runs.items()]


def median_device_row(schedule: str, runs: list[list[float]]) -> dict[str, Any]:
    """One schedule's per-device row from several fresh processes' peaks (`runs[r][device]`): each device's median
    (a device's peak moves by a few MiB between processes with the allocator's state), and every run."""
    return dict(workload="mlp", schedule=schedule, k=4, m=16, remat="never",
                device_peak_memory_mb=per_device.combine(runs, statistics.median, schedule),
                device_peak_memory_runs_mb=runs)


def table(rows: list[dict[str, Any]]) -> str:
    """The closing table."""
    cols = ["workload", "schedule", "k", "m", "remat", "step_time_s", "vs_one_worker", "efficiency",
            "efficiency_same_m",
            "efficiency_bound", "remat_cost", "flops_fraction", "compile_s", "peak_memory_mb"]
    widths = [max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    for r in rows:
        lines.append("  ".join(("-" if r.get(c) is None else str(r.get(c))).rjust(w) for c, w in zip(cols, widths)))
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The summary lines printed under the table: the ratios docs/benchmarks.md quotes beside the command."""
    out = []
    compile_rows = {(r["schedule"], r["m"]): r["compile_s"] for r in rows if r["step_time_s"] is None
                    and r["workload"] == "transformer"}
    for schedule in ("fill_drain", "unrolled"):
        if (schedule, 32) in compile_rows and (schedule, 4) in compile_rows:
            out.append(f"compile growth M=32/M=4 ({schedule}): "
                       f"{compile_rows[(schedule, 32)] / compile_rows[(schedule, 4)]:.2f}")
    mem = {(r["m"], r["remat"]): r["peak_memory_mb"] for r in rows if r["workload"] == "mlp" and r["k"] == 2}
    deep = {r["schedule"]: r["peak_memory_mb"] for r in rows if r["workload"] == "mlp" and r["k"] == 4}
    if "fill_drain" in deep and "one_f_one_b" in deep:
        out.append(f"peak memory K=4 M=16 no remat one_f_one_b / fill_drain: "
                   f"{deep['one_f_one_b'] / deep['fill_drain']:.2f} ({deep['one_f_one_b']} / {deep['fill_drain']} MiB)")
    if (1, "never") in mem and (8, "always") in mem:
        out.append(f"peak memory remat always M=8 / no remat M=1: {mem[(8, 'always')] / mem[(1, 'never')]:.2f}")
        remat_peaks = [mem[key] for key in sorted(k for k in mem if k[1] == "always")]
        monotone = all(a >= b for a, b in zip(remat_peaks, remat_peaks[1:]))
        out.append(f"peak memory with remat non-increasing in M: {monotone}")
    step = {(r["workload"], r["k"], r["m"], r["remat"], r["schedule"]): r for r in rows if r["step_time_s"]}
    for remat in ("never", "always"):
        a, b = step.get(("transformer", 2, 8, remat, "fill_drain")), step.get(("transformer", 2, 8, remat, "unrolled"))
        if a and b and a["efficiency"] is not None:
            out.append(f"E(2,8) remat={remat}: fill_drain {a['efficiency']} vs unrolled {b['efficiency']} "
                       f"(bound {a['efficiency_bound']})")
        if a and b:
            out.append(f"workload (a) K=2 M=8 remat={remat} step fill_drain / unrolled: "
                       f"{a['step_time_s'] / b['step_time_s']:.2f}")
    a, b = step.get(("heavy", 2, 8, "never", "fill_drain")), step.get(("heavy", 2, 8, "never", "unrolled"))
    if a and b:
        out.append(f"weight-heavy step fill_drain / unrolled: {a['step_time_s'] / b['step_time_s']:.2f}")
    a, b = step.get(("transformer", 2, 8, "never", "one_f_one_b")), step.get(("transformer", 2, 8, "never",
                                                                              "fill_drain"))
    if a and b:
        out.append(f"workload (a) K=2 M=8 remat=never step one_f_one_b / fill_drain: "
                   f"{a['step_time_s'] / b['step_time_s']:.3f}")
    for (workload, k, m, remat, schedule), a in step.items():
        plain = step.get((workload, k, m, remat, schedule.removesuffix(XLA)))
        if schedule.endswith(XLA) and plain:
            out.append(f"{workload} K={k} M={m} {schedule.removesuffix(XLA)} step with XLA / without: "
                       f"{a['step_time_s'] / plain['step_time_s']:.2f} ({a['step_time_s']} / {plain['step_time_s']} s)")
    base = step.get(("heavy", 2, 8, "never", "unrolled"))
    for schedule in HEAVY_SCHEDULES:
        a = step.get(("heavy", 2, 8, "never", schedule))
        if a and base:
            out.append(f"weight-heavy step {schedule} / unrolled: {a['step_time_s'] / base['step_time_s']:.2f}")
    for schedule in ("zero_bubble", "zero_bubble_v"):
        if schedule in deep and "one_f_one_b" in deep:
            out.append(f"peak memory K=4 M=16 no remat {schedule} / one_f_one_b: "
                       f"{deep[schedule] / deep['one_f_one_b']:.2f} ({deep[schedule]} / {deep['one_f_one_b']} MiB)")
    at_8 = [(r["step_time_s"], r["schedule"], r["efficiency"], r["efficiency_same_m"])
            for key, r in sorted(step.items()) if key[:4] == ("transformer", 2, 8, "never")]
    if at_8 and all(e is not None for _, _, e, _ in at_8):
        out.append("K=2 M=8 remat=never step s (E, E same M): " + ", ".join(
            f"{sch} {t:.4f} ({e}, {same})" for t, sch, e, same in sorted(at_8)))
    one = [(r["schedule"], r["step_time_s"]) for key, r in sorted(step.items())
           if key[:4] == ("transformer", 1, 8, "never")]  # the K=2 M=8 steps it bounds run without remat
    if one:
        out.append("one worker M=8 step s (half: the least a K=2 M=8 step can take with these kernels): " + ", ".join(
            f"{sch} {t:.4f} ({t / 2:.4f})" for sch, t in one))
    a, b = step.get(("transformer", 2, 4, "never", "interleaved")), step.get(("transformer", 2, 4, "never",
                                                                              "fill_drain"))
    if a and b and a["efficiency"] is not None:
        out.append(f"E(2,4) remat=never: interleaved v=2 {a['efficiency']} (bound {a['efficiency_bound']}) vs "
                   f"fill_drain {b['efficiency']} (bound {b['efficiency_bound']})")
    return out


def main() -> None:
    """Parses flags, runs the measurements, prints JSON lines and the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced configuration set (< 10 minutes)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all configurations")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round (2: the "
                        "medians that judge ratios near 1.0 come from twice the samples of one step per round)")
    parser.add_argument("--skip-memory", action="store_true", help="speed only")
    parser.add_argument("--peer", action="store_true", help="the configurations of the torch peer only: the "
                        "one-worker step, every schedule at K=2, M=8 without remat and fill_drain with remat (run "
                        "beside torch.distributed.pipelining's schedules on the same workload, in the same session)")
    parser.add_argument("--xla", action="store_true", help="XLA stage cells (jit_compile) against TensorFlow's "
                        "kernels: the one-worker step at M=8 and every schedule at K=2, M=8, both ways in one run")
    parser.add_argument("--compare", action="store_true", help="FillDrain and Unrolled side by side only: K=2, M=8 "
                        "on workload (a) with and without remat, and with the zero-bubble schedules on the "
                        "weight-heavy workload (no memory part)")
    parser.add_argument("--memory-processes", type=positive_count, default=3,
                        help="fresh processes per schedule for the per-device memory figures, whose medians are "
                             "printed (default 3)")
    parser.add_argument("--skip-speed", action="store_true",
                        help="memory only: in one process, and per device on 4 workers")
    parser.add_argument("--breakdown", action="store_true", help="only the one-worker step's time by op category "
                        "(matmul, attention, normalization, elementwise, transfer, idle)")
    parser.add_argument("--timeline", action="store_true", help="only the measured timelines: profiled steps of "
                        "fill_drain, one_f_one_b, interleaved (v=2), zero_bubble and zero_bubble_v at K=2 on two "
                        "workers, drawn beside the predicted ones")
    parser.add_argument("--micro-batches", type=lambda text: [int(m) for m in text.split(",")], default=[4, 8],
                        help="--timeline: the values of M, comma-separated (default 4,8)")
    parser.add_argument("--schedules", type=_timeline_schedules, default=list(TIMELINE_SCHEDULES),
                        help=f"--timeline: the schedules, comma-separated (default {','.join(TIMELINE_SCHEDULES)})")
    parser.add_argument("--traced-steps", type=int, default=3,
                        help="--timeline: traced steps per configuration; the median bubble is reported")
    parser.add_argument("--workload", default="transformer", choices=("transformer", "tiny"),
                        help="the workload of --timeline: workload (a), or a small MLP for a quick look")
    parser.add_argument("--out", default="bench_timelines", help="where --timeline writes its pictures")
    parser.add_argument("--repredict", metavar="DIR", help="only the predictions again: for the measured timelines a "
                        "--timeline run saved in DIR (no profiling), with the current timeline.predict; redraws the "
                        "pictures there")
    parser.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--breakdown-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device-memory-worker", metavar="SCHEDULE", help=argparse.SUPPRESS)
    parser.add_argument("--dxk", action="store_true", help="D x K mode instead: throughput of D=2,K=1 / D=1,K=2 / "
                        "D=2,K=2 vs D=1,K=1 on 4 logical CPU devices (runs bench.data_parallel)")
    args = parser.parse_args()
    if args.dxk:
        cmd = [sys.executable, "-m", "bench.data_parallel", "--repeats", str(min(args.repeats, 3))]
        sys.exit(subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).returncode)
    if args.memory_worker:
        memory_worker(args.quick)
        return
    if args.breakdown_worker:
        breakdown_worker(args.steps)
        return
    if args.device_memory_worker:
        device_memory_worker(args.device_memory_worker, args.steps)
        return
    if args.repredict:
        for line in repredict(args.repredict, args.workload):
            print(line)
        return
    if args.timeline:
        for line in timelines(args):
            print(line)
        return
    skips_breakdown = args.compare or args.peer or args.xla or args.skip_speed
    parts = breakdown(args) if args.breakdown or not skips_breakdown else None
    if parts is not None:
        print(json.dumps(dict(breakdown=parts)), flush=True)
    if args.breakdown:
        print(breakdown_line(parts))
        return
    rows, device_rows = [], []
    if not (args.skip_memory or args.compare or args.peer or args.xla):
        rows, device_rows = memory(args)
    for row in rows + device_rows:
        print(json.dumps(row), flush=True)
    speed_rows, traced_lines = ([], []) if args.skip_speed else speed(args)
    for row in speed_rows:
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows))
    for line in summary(rows) + device_memory_lines(device_rows):
        print(line)
    if parts is not None:
        print(breakdown_line(parts))
    for line in traced_lines:
        print(line)


if __name__ == "__main__":
    main()
