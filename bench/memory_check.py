"""The memory planner against whole pipelined training steps on faithful devices: every device's predicted and
measured peak, for configurations spanning the families, schedules, remat policies, optimizers and precisions.

  python -m bench.memory_check                       # the validation table (docs/memory.md)
  python -m bench.memory_check --only mlp-k2-m4-fd-never-adam-f32,amoebanet-k2-m4-fd-always-rmsprop-f32
  python -m bench.memory_check --list
  python -m bench.memory_check --processes 3         # each device's largest peaks over 3 fresh processes

Each configuration runs in a fresh process (`bench.step_memory`): K single-thread TensorFlow workers, stage k on
worker k, the trainer's own train step on the experiment's input, each worker's BFC allocator read from inside
the worker. The prediction is the planner's (`gpipe_tf.memory.plan.plan_pipeline`, the loss head included).
Two measured peaks per device: "tensors", the most bytes its tensors held at once in traced steps (the allocator's
bytes in use less the unused part of the chunks it handed out whole: `step_memory.tensors_peak`), and "allocator",
the allocator's own peak over five steps. BFC hands out a free chunk whole unless it is at least twice the request,
so the allocator's peak carries a share of unused bytes that depends on which chunks earlier steps left free: the
same device's allocator peak moves between runs where its tensors' peak does not. Each column has its error
(predicted / measured - 1); the planner's bound is within 10% and never more than 5% under. With several processes
the check also says how far each peak moved between them: a device whose peaks differ by more than 1.10 / 0.95 =
1.158x between two processes cannot be within the bound of both with any one prediction (`spread`).

TensorFlow's own CPU kernels run (`TF_ENABLE_ONEDNN_OPTS=0` unless the environment sets it): the kernels the
planner's convolution scratch (`BaseLayer.scratch_bytes`) was traced on. docs/memory.md says how much the kernel
library moved the measured peaks.
"""

from __future__ import annotations

import argparse
import os
import shlex

from bench import per_device
from bench.cli import positive_count
from bench.isolated_memory import Config

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TOLERANCE = 0.10  # |error| bound
UNDER = 0.05  # the most a prediction may be under


_MLP = ("toy.classifier.BlobsMlpGPipe", ("BlobsMlpGPipe.hidden_dims=(2048, 2048, 2048, 2048)",
                                         "BlobsMlpGPipe.input_dim=2048", "BlobsMlpGPipe.dropout_rate=0.0",
                                         "BlobsMlpGPipe.batch_size=256"))
_TRANSFORMER = ("mt.gpipe_paper.TransformerLTinyOffline", (
    "TransformerLTinyOffline.num_layers=4", "TransformerLTinyOffline.model_dim=128",
    "TransformerLTinyOffline.hidden_dim=512", "TransformerLTinyOffline.max_length=64",
    "TransformerLTinyOffline.vocab_size=2048", "TransformerLTinyOffline.batch_size=32"))
_AMOEBA = ("image.amoebanet.AmoebaNetTinyOffline", ("AmoebaNetTinyOffline.image_size=32",
                                                   "AmoebaNetTinyOffline.batch_size=32"))
_FAMILIES = {"mlp": _MLP, "transformer": _TRANSFORMER, "amoebanet": _AMOEBA}
_SCHEDULES = {"fd": "fill_drain", "unrolled": "unrolled", "1f1b": "one_f_one_b", "interleaved": "interleaved",
              "zb": "zero_bubble", "zbv": "zero_bubble_v"}
_OPTIMIZERS = {
    "sgd": "train.optimizer=gpipe_tf.training.optimizers.SGD",
    "momentum": "train.optimizer=gpipe_tf.training.optimizers.SGD,train.optimizer.momentum=0.9",
    "rmsprop": "train.optimizer=gpipe_tf.training.optimizers.RMSProp",
    "adam": "train.optimizer=gpipe_tf.training.optimizers.Adam",
    "adamw": "train.optimizer=gpipe_tf.training.optimizers.AdamW",
    "adafactor": "train.optimizer=gpipe_tf.training.adafactor.Adafactor",
}


def config(family: str, k: int, m: int, schedule: str, remat: str, optimizer: str, dtype: str) -> Config:
    """The configuration named `{family}-k{K}-m{M}-{schedule}-{remat}-{optimizer}-{f32|bf16}`; a schedule ending
    in "+w" batches its weight gradients."""
    model, gin = _FAMILIES[family]
    batched = schedule.endswith("+w")
    parts = [f"task.network.num_stages={k}", f"task.network.num_micro_batches={m}",
             f"task.network.remat='{remat}'", f"task.network.schedule={_SCHEDULES[schedule.rstrip('+w')]}"]
    if batched:
        parts.append("task.network.schedule.batch_weight_gradients=True")
    parts.append(_OPTIMIZERS[optimizer])
    if dtype == "bf16":
        parts.append("task.fprop_dtype=bfloat16")
    name = f"{family}-k{k}-m{m}-{schedule}-{remat}-{optimizer}-{dtype}"
    return Config(name, model, gin, ",".join(parts))


CONFIGS = [
    config("mlp", 2, 4, "fd", "never", "adam", "f32"),
    config("mlp", 4, 8, "1f1b", "always", "sgd", "f32"),
    config("mlp", 2, 8, "unrolled", "never", "momentum", "bf16"),
    config("mlp", 2, 4, "zb", "never", "rmsprop", "f32"),
    config("mlp", 2, 8, "zb+w", "never", "adamw", "f32"),
    config("mlp", 2, 8, "zbv", "always", "adafactor", "f32"),
    config("transformer", 4, 8, "1f1b", "never", "adam", "f32"),
    config("transformer", 2, 8, "fd", "always", "adam", "bf16"),
    config("transformer", 2, 4, "interleaved", "never", "adamw", "f32"),
    config("transformer", 2, 8, "zbv+w", "never", "adam", "f32"),
    config("transformer", 3, 4, "unrolled", "always", "adafactor", "f32"),
    config("amoebanet", 2, 4, "fd", "always", "rmsprop", "f32"),
    config("amoebanet", 4, 8, "1f1b", "never", "momentum", "f32"),
    config("amoebanet", 2, 4, "interleaved", "never", "adam", "bf16"),
]


def largest_over_runs(results: list[dict]) -> dict:
    """One configuration's `step_memory` results from several fresh processes as one: per device the largest
    tensors' and allocator peak (a device must hold what any run of the step took), every run's kept
    ("tensors_runs", "allocator_runs": per run, per device)."""
    tensors = [r["tensors"] for r in results]
    allocator = [r["measured"] for r in results]
    largest = {"tensors": per_device.combine(tensors, max, "tensors' peaks"),
               "measured": per_device.combine(allocator, max, "allocator peaks")}
    return {**results[0], **largest, "tensors_runs": tensors, "allocator_runs": allocator}


def spread(rows: list[dict], key: str) -> dict:
    """How far each device's peaks (`key`: "tensors_runs" or "allocator_runs" of `check`'s rows) moved between
    processes: {"widest": the row whose largest / smallest peak is the largest, "ratio": that quotient, "moved":
    the rows whose quotient exceeds (1 + TOLERANCE) / (1 - UNDER), the most two measurements of one device may
    differ for any one prediction to be within the bound of both}."""
    def ratio(row: dict) -> float:
        return max(row[key]) / min(row[key])
    widest = max(rows, key=ratio)
    return {"widest": widest, "ratio": ratio(widest),
            "moved": [r for r in rows if ratio(r) > (1 + TOLERANCE) / (1 - UNDER)]}


def check(configs: list[Config], log: bool = True, processes: int = 1) -> list[dict]:
    """Measures each configuration (`processes` fresh processes each, per device the largest of them) and prints
    one row per device as it goes; returns [{"config", "device", "stashed", "predicted", "measured" (the tensors'
    peak), "error", "allocator", "allocator_error", "tensors_runs", "allocator_runs" (each process's peak)}]."""
    from bench import step_memory

    # TensorFlow's own kernels unless the environment chooses (the module doc says why).
    kernels = {"TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "0")}
    rows = []
    if log:
        print(f"{'configuration':<45} {'device':>6} {'stash':>5} {'predicted MiB':>13} {'tensors MiB':>11} "
              f"{'error':>7} {'allocator MiB':>13} {'error':>7}", flush=True)
    for c in configs:
        result = largest_over_runs([
            step_memory.measure_in_fresh_process(c.model, c.gin, c.overrides, env=kernels, tensors=True)
            for _ in range(processes)])
        for d, (predicted, measured, allocator) in enumerate(zip(result["predicted"], result["tensors"],
                                                                 result["measured"])):
            row = {"config": c.name, "device": d, "predicted": predicted, "measured": measured,
                   "error": predicted / measured - 1, "allocator": allocator,
                   "allocator_error": predicted / allocator - 1,
                   "stashed": result["plan"]["devices"][d]["stashed_micro_batches"],
                   "tensors_runs": [run[d] for run in result["tensors_runs"]],
                   "allocator_runs": [run[d] for run in result["allocator_runs"]]}
            rows.append(row)
            if log:
                print(f"{c.name:<45} {d:>6} {row['stashed']:>5} {predicted / 2 ** 20:>13.2f} "
                      f"{measured / 2 ** 20:>11.2f} {row['error']:>+7.1%} {allocator / 2 ** 20:>13.2f} "
                      f"{row['allocator_error']:>+7.1%}", flush=True)
    return rows


def summary(rows: list[dict], processes: int) -> list[str]:
    """The lines under the table (`check`'s rows): per measured peak the largest error and how many devices are
    outside the bound; the largest ratio of a device's allocator peak to its tensors' peak (each the largest over
    the processes: what a budget must hold against what a plan of the tensors predicts); and over several
    processes how far the peaks moved (`spread`), naming the devices that moved beyond what one prediction can be
    within the bound of."""
    lines = []
    for key, what in (("error", "tensors"), ("allocator_error", "allocator")):
        outside = [r for r in rows if abs(r[key]) > TOLERANCE or r[key] < -UNDER]
        worst = max(rows, key=lambda r: abs(r[key]))
        lines.append(f"against the {what} peak: largest error {worst[key]:+.1%} ({worst['config']} device "
                     f"{worst['device']}); {len(outside)} of {len(rows)} devices outside [-{UNDER:.0%}, "
                     f"+{TOLERANCE:.0%}]")
    slack = max(rows, key=lambda r: r["allocator"] / r["measured"])
    lines.append(f"allocator / tensors: largest {slack['allocator'] / slack['measured']:.3f}x ({slack['config']} "
                 f"device {slack['device']}), the unused part of the allocator's chunks a budget must allow on top "
                 "of the tensors")
    if processes > 1:
        band = (1 + TOLERANCE) / (1 - UNDER)
        for key, what in (("tensors_runs", "tensors"), ("allocator_runs", "allocator")):
            moved = spread(rows, key)
            widest = moved["widest"]
            lines.append(f"{what} peaks over {processes} processes: widest spread {moved['ratio']:.3f}x "
                         f"({widest['config']} device {widest['device']}: {_range(widest[key])}); "
                         f"{len(moved['moved'])} of {len(rows)} devices moved more than {band:.3f}x, beyond what "
                         "one prediction can be within the bound of")
            lines += [f"  {r['config']} device {r['device']}: {_range(r[key])}" for r in moved["moved"]]
    return lines


def _range(peaks: list[int]) -> str:
    return f"{min(peaks) / 2 ** 20:.2f}-{max(peaks) / 2 ** 20:.2f} MiB"


def main() -> None:
    """Prints the table, then its `summary`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="Comma-separated configuration names (default: all).")
    parser.add_argument("--list", action="store_true", help="Print the configurations and their overrides.")
    parser.add_argument("--processes", type=positive_count, default=1, help="Fresh processes per configuration; "
                        "each device's peaks are the largest of them (default 1).")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in CONFIGS})
    if unknown:
        parser.error(f"--only: unknown configuration(s) {unknown}; --list prints the names")
    chosen = [c for c in CONFIGS if not names or c.name in names]
    if args.list:
        for c in chosen:  # each line's flags paste into `python -m bench.step_memory`
            flags = [f"--model={c.model}", *[f"--gin_param={g}" for g in c.gin], f"--params={c.overrides}"]
            print(f"{c.name}: {shlex.join(flags)}")
        return
    rows = check(chosen, processes=args.processes)
    print("\n".join(summary(rows, args.processes)))


if __name__ == "__main__":
    main()
