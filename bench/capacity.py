"""The largest model that fits: the memory planner's answer for each column of the GPipe paper's Table 1.

  python -m bench.capacity --paper                 # both families, every column (about a minute)
  python -m bench.capacity --paper --family transformer

For each column (K devices, the paper's per-core memory, batch, image or sequence size) the planner
(`gpipe_tf.memory.plan`) is asked, by bisection, for the largest model of the column's family that fits every
device: AmoebaNet-D with the column's published number of normal cells L, growing the filters D (multiples of 8);
the Transformer (d_model 2048, FFN 8192, 32 heads, 32k vocabulary, sequence 1024, batch 32), growing the layers.
Settings as in the paper: Naive-1 is one device, one micro-batch and no rematerialization; Pipeline-k has k stages
and rematerializes every stage; micro-batches M=32 (the repository's Transformer-L experiments'); RMSProp (12 bytes
per parameter with its gradient, the paper's accounting), float32. Beside each answer: the published model, its
parameter count and the published parameter and peak activation memory (totals over the cores), and ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from gpipe_tf.hyperparams import Params  # TensorFlow-free, unlike the modules main() imports after the line below

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of Table 1: its setting and the published figures (memory in GB, totals over the cores)."""

    family: str
    name: str
    devices: int
    published: str
    published_params: float
    param_memory_gb: float
    activation_memory_gb: float
    size: int  # AmoebaNet: L (normal cells); Transformer: unused


PAPER = [
    Column("amoebanet", "Naive-1", 1, "(18, 208)", 82e6, 1.05, 6.26, 18),
    Column("amoebanet", "Pipeline-1", 1, "(18, 416)", 318e6, 3.8, 3.46, 18),
    Column("amoebanet", "Pipeline-2", 2, "(18, 544)", 542e6, 6.45, 8.11, 18),
    Column("amoebanet", "Pipeline-4", 4, "(36, 544)", 1.05e9, 12.53, 15.21, 36),
    Column("amoebanet", "Pipeline-8", 8, "(72, 512)", 1.8e9, 24.62, 26.24, 72),
    Column("transformer", "Naive-1", 1, "L=3", 282.2e6, 11.7, 3.15, 0),
    Column("transformer", "Pipeline-1", 1, "L=13", 785.8e6, 8.8, 6.4, 0),
    Column("transformer", "Pipeline-8", 8, "L=103", 5.3e9, 59.5, 50.9, 0),
    Column("transformer", "Pipeline-32", 32, "L=415", 21.0e9, 235.1, 199.9, 0),
    Column("transformer", "Pipeline-128", 128, "L=1663", 83.9e9, 937.9, 796.1, 0),
]
BUDGET = {"amoebanet": 8 * GiB, "transformer": 16 * GiB}
MICRO_BATCHES = 32


def _setting(column: Column, kind: str) -> list[str]:
    naive = column.name == "Naive-1"
    return [f"{kind}.num_stages={column.devices}", f"{kind}.num_micro_batches={1 if naive else MICRO_BATCHES}",
            f"{kind}.remat='{'never' if naive else 'always'}'"]


def amoebanet_params(column: Column, filters: int) -> Params:
    """Params of AmoebaNet-D (L, filters) at 224x224, batch 128, RMSProp, in the column's setting."""
    from gpipe_tf import experiment

    kind = "AmoebaNetD_18_208"
    gin = [f"{kind}.filters={filters}", f"{kind}.num_cells_per_stack={column.size // 3}", *_setting(column, kind)]
    params, _ = experiment.resolve_params(f"image.amoebanet.{kind}", gin_bindings=gin)
    return params


def transformer_params(column: Column, layers: int) -> Params:
    """Params of the Transformer of Table 1 with `layers` layers, batch 32, sequence 1024, RMSProp."""
    from gpipe_tf import experiment
    from gpipe_tf.training.optimizers import RMSProp

    kind = "TransformerL_3"
    m = 1 if column.name == "Naive-1" else MICRO_BATCHES
    params, _ = experiment.resolve_params(
        f"mt.gpipe_paper.{kind}", gin_bindings=[f"{kind}.num_layers={layers}", *_setting(column, kind)],
        overrides=f"task.network.micro_batch_shape=[{32 // m}, 1024],task.network.input_dtype='int32'")
    params = params.copy()
    params.train.optimizer = RMSProp.params()
    return params


def plan_of(params: Params) -> dict:
    """The planner's per-device plan of an experiment's pipeline against its family's budget."""
    from gpipe_tf.gpipe.pipeline import find_pipelines
    from gpipe_tf.memory.head import task_head
    from gpipe_tf.memory.plan import plan_pipeline

    budget = BUDGET["amoebanet" if "amoeba" in params.model else "transformer"]
    pipe = dict(find_pipelines(params.task))["task.network"]
    return plan_pipeline(pipe, params.train, "task.network", budget, head=task_head(params.task, "task.network"))


def run_column(column: Column) -> dict:
    """The planner's largest model for `column` and its figures."""
    from gpipe_tf.capacity import largest

    if column.family == "amoebanet":
        def build(n: int):
            return amoebanet_params(column, n)
        best = largest(lambda n: plan_of(build(n))["fits"], 16, 512, 8)
    else:
        def build(n: int):
            return transformer_params(column, n)
        best = largest(lambda n: plan_of(build(n))["fits"], max(1, column.devices - 1),
                       max(8, column.devices * 16), 1)
    published = build(int(column.published.split(",")[1].strip(" )")) if column.family == "amoebanet"
                      else int(column.published[2:]))
    published_peak = plan_of(published)["max_peak"]
    if best is None:
        return {"best": None, "published_peak": published_peak}
    params = build(best)
    plan = plan_of(params)
    from gpipe_tf.layers.base_layer import count_params

    devices = plan["devices"]
    return {"best": best, "params": count_params(params.task),
            "param_memory": sum(d["weights"] + d["gradient_sums"] + d["optimizer_slots"] for d in devices),
            "activation_memory": sum(d["stashed_activations"] + d["recompute"] for d in devices),
            "peak": plan["max_peak"], "published_peak": published_peak}


def main() -> None:
    """Prints one row per Table 1 column."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paper", action="store_true", help="Table 1's columns (the only table so far).")
    parser.add_argument("--family", choices=("amoebanet", "transformer"), default=None)
    args = parser.parse_args()
    if not args.paper:
        parser.error("give --paper")
    print(f"{'family':<11} {'column':<12} {'K':>3} {'published':>10} {'params':>8} {'mem P/A GB':>12} | "
          f"{'planner':>10} {'params':>8} {'ratio':>6} {'mem P/A GB':>12} {'peak GiB':>8} {'secs':>5}  "
          "published model's predicted peak GiB")
    for column in PAPER:
        if args.family and column.family != args.family:
            continue
        start = time.perf_counter()
        row = run_column(column)
        secs = time.perf_counter() - start
        published = f"{column.published_params / 1e9:.2f}B"
        mine = "-" if row["best"] is None else (f"(L{column.size}, D{row['best']})" if column.family == "amoebanet"
                                                 else f"L={row['best']}")
        ours = f"{'-':>8} {'-':>6} {'-':>12} {'-':>8}" if row["best"] is None else (
            f"{row['params'] / 1e9:.2f}B {row['params'] / column.published_params:>6.2f} "
            f"{row['param_memory'] / 1e9:>5.1f}/{row['activation_memory'] / 1e9:<6.1f} {row['peak'] / GiB:>8.2f}")
        print(f"{column.family:<11} {column.name:<12} {column.devices:>3} {column.published:>10} {published:>8} "
              f"{column.param_memory_gb:>5.2f}/{column.activation_memory_gb:<6.2f} | {mine:>10} {ours} {secs:>5.0f}  "
              f"{row['published_peak'] / GiB:.2f}", flush=True)


if __name__ == "__main__":
    main()
