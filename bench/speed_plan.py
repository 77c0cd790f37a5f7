"""The speed plan against the GPipe paper's Table 2: normalized training throughput of AmoebaNet-D (18, 256) and
Transformer-48 on TPUs, K in {2, 4, 8} partitions, M in {1, 4, 32} micro-batches, each normalized to K=2, M=1.

  python -m bench.speed_plan --paper                     # the 18 cells beside the plan's prediction
  python -m bench.speed_plan --paper --accelerator=tpu_v2

Each cell is `gpipe_tf.speed.step.predict_step` on the experiment's Params (nothing is built) with GPipe's
schedule (fill-drain), remat 'always', the batch fixed per model (`_MODELS`: the paper gives none for Table 2) and
split into M micro-batches. Transformer-48 is `mt.gpipe_paper.TransformerL_3` with 48 layers; its stages are
balanced by flops (the paper: Transformer layers balance). AmoebaNet-D (18, 256) is
`image.amoebanet.AmoebaNetD_18_208` with 256 filters, partitioned as `--amoeba_balance` says: 'layers' (the same
number of layers per partition) or 'params' (the same parameters per partition); the paper names its partitions
unbalanced and gives neither. error = predicted / paper - 1.
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


def _even_balance(num_layers: int, k: int) -> list[int]:
    return [num_layers // k + (1 if j < num_layers % k else 0) for j in range(k)]


def predict_table(name: str, device: Any, amoeba_balance: str) -> dict[int, list[float]]:
    """{M: [predicted throughput at K=2, 4, 8]} of model `name`, normalized to K=2, M=1."""
    from gpipe_tf.gpipe.batch_shapes import rescaled_micro_batch_shape
    from gpipe_tf.speed.step import predict_step

    model, knobs, batch = _MODELS[name]
    pipe, train, path, head = _pipeline(model, knobs)
    per_micro = pipe.micro_batch_shape
    first = [batch] + list(per_micro[1:])  # the whole batch as one micro-batch
    out: dict[int, list[float]] = {}
    for m in MICRO_BATCHES:
        row = []
        for k in STAGES:
            p = pipe.copy().set(num_stages=k, num_micro_batches=m, schedule="fill_drain", remat="always",
                                micro_batch_shape=rescaled_micro_batch_shape(first, 1, m))
            if name.startswith("AmoebaNet") and amoeba_balance == "layers":
                p.set(balance=_even_balance(len(p.layers), k))
            elif name.startswith("AmoebaNet"):
                p.set(balance=None, balance_by="params")
            else:
                p.set(balance=None, balance_by="flops")
            row.append(predict_step(p, train, device, head, path)["examples_per_second"])
        out[m] = row
    base = out[1][0]
    return {m: [t / base for t in row] for m, row in out.items()}


def main(argv: list[str] | None = None) -> int:
    """Prints Table 2 beside the prediction; the exit status is 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paper", action="store_true", help="Table 2 of the GPipe paper beside the prediction")
    parser.add_argument("--accelerator", default="tpu_v3", help="the device preset (gpipe_tf.speed.accelerators)")
    parser.add_argument("--amoeba_balance", choices=("layers", "params"), default="layers",
                        help="how AmoebaNet-D's partitions are cut")
    args = parser.parse_args(argv)
    if not args.paper:
        parser.error("give --paper (the only check so far)")
    from gpipe_tf.speed.accelerators import accelerator

    device = accelerator(args.accelerator)
    print(f"python -m bench.speed_plan {' '.join(argv if argv is not None else sys.argv[1:])}")
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
