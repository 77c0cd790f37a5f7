"""Predicted vs measured peak memory of each pipeline stage run alone, one fresh process per stage: the second view.

  python -m bench.isolated_memory            # 9 configurations, each stage alone
  python -m bench.isolated_memory --only mlp-k2-m4-never-fd

`bench.memory_check` is the validation: whole pipelined training steps on faithful devices. This view isolates
one stage's layers and the planner's stage model (`gpipe_tf.memory.stage`) from the schedule, the loss head and
the trainer's step around them, which is where to look first when a whole-step figure is off.

How a stage is isolated: its layers alone, as a one-stage GPipe (the pipeline's own schedule code) over as many
micro-batches as the configured schedule stashes on that stage (M for fill-drain, min(M, K - k) for 1F1B), each
micro-batch of the configured size, trained with the experiment's optimizer. Each runs in its own Python process
with TensorFlow's BFC allocator on the CPU (TF_CPU_ALLOCATOR_USE_BFC=1), so that
`tf.config.experimental.get_memory_info('CPU:0')` counts exactly this stage's tensors: measured = the bytes of the
stage's state (its variables, the optimizer's slots, the input batch and the output gradients, from the tensors
themselves) plus how far the second training step's peak rises above the bytes in use just before it (after
`reset_memory_stats`). What TensorFlow's runtime caches besides the state (the eager initializers' constants, the
first step's leftovers: 1-3 MiB here, printed as "cache") is left out: it belongs to the measuring process, not the
stage.
The prediction is the planner's (`gpipe_tf.memory.stage`) for the same stage run the same way: it holds the
whole (stash-sized) input and keeps every micro-batch's output and output gradient, as a one-stage pipeline does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@dataclasses.dataclass(frozen=True)
class Config:
    """One validation configuration: an experiment, its gin bindings and Params overrides."""

    name: str
    model: str
    gin: tuple[str, ...]
    overrides: str


_MLP = ("BlobsMlpGPipe.hidden_dims=(512, 512, 512, 512)", "BlobsMlpGPipe.input_dim=512",
        "BlobsMlpGPipe.dropout_rate=0.0")
_TRANSFORMER = ("TransformerLTinyOffline.num_layers=4", "TransformerLTinyOffline.model_dim=128",
                "TransformerLTinyOffline.hidden_dim=512", "TransformerLTinyOffline.max_length=64",
                "TransformerLTinyOffline.vocab_size=64")
_AMOEBA = ("AmoebaNetTinyOffline.image_size=32",)


def _net(k: int, m: int, remat: str, schedule: str, batch: int, shape: list[int], dtype: str) -> str:
    return (f"task.network.num_stages={k},task.network.num_micro_batches={m},task.network.remat='{remat}',"
            f"task.network.schedule='{schedule}',"
            f"task.network.micro_batch_shape={[batch // m] + shape},"
            f"task.network.input_dtype='{dtype}'")


CONFIGS = [
    Config("mlp-k1-m1-never-fd", "toy.classifier.BlobsMlpGPipe", _MLP,
           _net(1, 1, "never", "fill_drain", 256, [512], "float32")),
    Config("mlp-k2-m4-never-fd", "toy.classifier.BlobsMlpGPipe", _MLP,
           _net(2, 4, "never", "fill_drain", 256, [512], "float32")),
    Config("mlp-k4-m8-always-1f1b", "toy.classifier.BlobsMlpGPipe", _MLP,
           _net(4, 8, "always", "one_f_one_b", 256, [512], "float32")),
    Config("transformer-k1-m4-never-fd", "mt.gpipe_paper.TransformerLTinyOffline", _TRANSFORMER,
           _net(1, 4, "never", "fill_drain", 32, [64], "int32")),
    Config("transformer-k2-m8-always-fd", "mt.gpipe_paper.TransformerLTinyOffline", _TRANSFORMER,
           _net(2, 8, "always", "fill_drain", 32, [64], "int32")),
    Config("transformer-k4-m8-never-1f1b", "mt.gpipe_paper.TransformerLTinyOffline", _TRANSFORMER,
           _net(4, 8, "never", "one_f_one_b", 32, [64], "int32")),
    Config("amoebanet-k1-m1-never-fd", "image.amoebanet.AmoebaNetTinyOffline", _AMOEBA,
           _net(1, 1, "never", "fill_drain", 32, [32, 32, 3], "float32")),
    Config("amoebanet-k2-m4-always-fd", "image.amoebanet.AmoebaNetTinyOffline", _AMOEBA,
           _net(2, 4, "always", "fill_drain", 32, [32, 32, 3], "float32")),
    Config("amoebanet-k4-m8-never-1f1b", "image.amoebanet.AmoebaNetTinyOffline", _AMOEBA,
           _net(4, 8, "never", "one_f_one_b", 32, [32, 32, 3], "float32")),
]


def isolated_stages(model: str, gin: tuple[str, ...], overrides: str) -> tuple[Any, list[dict[str, Any]]]:
    """(params, [per stage: layer Params, names, input spec, stash count, remat, predicted StageMemory]) for the
    stages of the configured pipeline, each run alone as the module doc says."""
    import tensorflow as tf

    from gpipe_tf import experiment
    from gpipe_tf.gpipe.pipeline import find_pipelines
    from gpipe_tf.gpipe.plan import make_plan, micro_batch_spec
    from gpipe_tf.memory import plan as plan_lib
    from gpipe_tf.memory import stage as stage_lib
    from gpipe_tf.memory.stash import stashed_micro_batches

    params, _ = experiment.resolve_params(model, gin_bindings=list(gin), overrides=overrides)
    pipe = dict(find_pipelines(params.task))["task.network"]  # with the dtypes it inherits from the task
    order = plan_lib.schedule_order(pipe, "task.network")
    plan = make_plan(pipe, chunk_devices=order.devices_by_chunk, num_replicas=None, measure=None, path="task.network")
    stashes = stashed_micro_batches(order, pipe.num_micro_batches)
    compute = tf.as_dtype(pipe.fprop_dtype)  # find_pipelines states it
    spec = stage_lib.compute_spec(micro_batch_spec(pipe, "task.network"), compute.name)
    stages = []
    for s, names in enumerate(plan.stage_layers):
        layers = [pipe.layers[j] for j in plan.layer_indices(s)]
        traces = stage_lib.trace_layers(layers, spec, names)
        setting = stage_lib.StageSetting(
            micro_batches=stashes[s], stashed=stashes[s], remat=plan.remat[s], first=True, last=True,
            kept_outputs=2 * stashes[s], input_gradient=s > 0, variable_bytes=tf.as_dtype(pipe.dtype or "float32").size,
            compute_bytes=compute.size, optimizer=plan_lib.optimizer_memory(params.train.optimizer))
        stages.append({"layers": layers, "names": list(names), "spec": spec, "stashed": stashes[s],
                       "remat": plan.remat[s], "predicted": stage_lib.stage_memory(traces, spec, setting),
                       "out_spec": traces[-1].output_spec})
        spec = traces[-1].output_spec
    return params, stages


def measure_stage(model: str, gin: tuple[str, ...], overrides: str, stage: int) -> dict[str, int]:
    """Runs stage `stage` alone (module doc) in this process; {"measured", "predicted"} bytes."""
    import tensorflow as tf

    from gpipe_tf.gpipe.pipeline import GPipe
    from gpipe_tf.layers.base_layer import FPropContext

    params, stages = isolated_stages(model, gin, overrides)
    info = stages[stage]
    memory = tf.config.experimental
    baseline = memory.get_memory_info("CPU:0")["current"]
    m = info["stashed"]  # the one-stage pipeline's M: the schedule's stash count on this stage
    pipe = GPipe.params().set(
        name="stage", dtype=params.task.network.dtype or "float32", fprop_dtype=params.task.network.fprop_dtype,
        layers=info["layers"], num_stages=1, num_micro_batches=m, remat="always" if info["remat"] else "never",
        device_kind="cpu", input_gradients=stage > 0).instantiate()
    variables = pipe.trainable_variables
    optimizer = params.train.optimizer.instantiate()
    optimizer.build(variables)

    def full(spec: tf.TensorSpec, seed: int) -> tf.Tensor:
        shape = [spec.shape[0] * m] + spec.shape[1:].as_list()
        if spec.dtype.is_floating:
            return tf.random.stateless_normal(shape, [seed, 1], dtype=spec.dtype)
        return tf.random.stateless_uniform(shape, [seed, 2], minval=0, maxval=2, dtype=spec.dtype)

    flat_specs = tf.nest.flatten(info["spec"])
    x = tf.nest.pack_sequence_as(info["spec"], [full(sp, i) for i, sp in enumerate(flat_specs)])
    ctx = FPropContext(training=True, seed=tf.constant([1, 2], tf.int64))

    @tf.function(autograph=False)
    def step(x: Any, weights: Any) -> tf.Tensor:
        floats = [t for t in tf.nest.flatten(x) if t.dtype.is_floating] if stage > 0 else []
        with tf.GradientTape() as tape:
            tape.watch(floats)
            outs = [o for o in tf.nest.flatten(pipe.fprop(pipe.theta, x, ctx)) if o.dtype.is_floating]
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32) * w) for o, w in zip(outs, weights)])
        grads = tape.gradient(loss, [*variables, *floats])
        optimizer.apply_gradients(zip(grads[:len(variables)], variables), 1e-3)
        # A later stage sends its input's gradient back: returned, so that it is computed.
        return loss, grads[len(variables):]

    # The output gradients: fixed tensors, as the next stage would send them.
    weights = [full(sp, 100 + i) for i, sp in enumerate(tf.nest.flatten(info["out_spec"]))
               if sp.dtype.is_floating]
    step(x, weights)
    memory.reset_memory_stats("CPU:0")
    before = memory.get_memory_info("CPU:0")["current"]
    step(x, weights)
    rise = memory.get_memory_info("CPU:0")["peak"] - before
    state = [*pipe.variables, *[s for slots in optimizer.slots.values() for s in slots.values()],
             *tf.nest.flatten(x), *weights]
    state_bytes = sum(int(tf.size(t)) * t.dtype.size for t in state)
    return {"measured": int(state_bytes + rise), "predicted": int(info["predicted"].peak),
            "runtime_cache": int(before - baseline - state_bytes)}


def measure_configs(jobs: list[dict[str, Any]]) -> list[list[dict[str, int]]]:
    """Every stage of every job ({"model", "gin", "overrides"}) measured in this process, one after another (each
    measurement counts from the bytes in use before its own step, so earlier ones do not count)."""
    import gc

    results = []
    for job in jobs:
        _, stages = isolated_stages(job["model"], tuple(job["gin"]), job["overrides"])
        per_stage = []
        for s in range(len(stages)):
            per_stage.append(measure_stage(job["model"], tuple(job["gin"]), job["overrides"], s))
            gc.collect()
        results.append(per_stage)
    return results


def measure_in_fresh_process(jobs: list[dict[str, Any]]) -> list[list[dict[str, int]]]:
    """`measure_configs` in a fresh Python process with TensorFlow's BFC allocator (the module doc)."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="2")
    args = [sys.executable, "-m", "bench.isolated_memory", "--measure", json.dumps(jobs)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"measuring {jobs} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_child(config: Config, stage: int) -> dict[str, int]:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="2")
    args = [sys.executable, "-m", "bench.isolated_memory", "--child",
            json.dumps({"model": config.model, "gin": config.gin, "overrides": config.overrides, "stage": stage})]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{config.name} stage {stage} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Prints the table: configuration, stage, stashed micro-batches, predicted, measured, error."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="", help="Comma-separated configuration names (default: all).")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_configs(json.loads(args.measure))))
        return
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(measure_stage(job["model"], tuple(job["gin"]), job["overrides"], job["stage"])))
        return
    chosen = [c for c in CONFIGS if not args.only or c.name in args.only.split(",")]
    print(f"{'configuration':<30} {'stage':>5} {'stash':>5} {'predicted MiB':>13} {'measured MiB':>12} {'error':>7} "
          f"{'cache MiB':>9}")
    worst = 0.0
    for config in chosen:
        _, stages = isolated_stages(config.model, config.gin, config.overrides)
        for s, info in enumerate(stages):
            result = _run_child(config, s)
            error = result["predicted"] / result["measured"] - 1
            worst = max(worst, abs(error))
            print(f"{config.name:<30} {s:>5} {info['stashed']:>5} {result['predicted'] / 2**20:>13.2f} "
                  f"{result['measured'] / 2**20:>12.2f} {error:>+7.1%} {result['runtime_cache'] / 2**20:>9.2f}",
                  flush=True)
    print(f"largest error: {worst:.1%}")


if __name__ == "__main__":
    main()
