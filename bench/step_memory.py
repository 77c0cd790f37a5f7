"""Each device's peak memory in whole pipelined training steps on faithful devices: what the trainer runs.

K single-thread TensorFlow workers on 127.0.0.1 (`gpipe_tf.workers.LocalWorkers`), stage k on worker k, each with
TensorFlow's BFC allocator on its CPU. The client builds the experiment's task and the trainer's own `Learner`
(its `train_step`: the pipeline's schedule, the loss head, gradient clipping, the finiteness checks, the optimizer
update) and runs it on a batch of the experiment's own training input. The client cannot read a remote device's
allocator, so each worker reads its own and answers over a small socket (`LocalWorkers(memory=True)`).

measured, per worker = the worker's allocator peak over every step but the first (after `reset_memory_stats`)
minus the bytes it held before the task was built. The first step warms up: it creates the optimizer's slots and
the workers' functions. A step's peak moves from step to step with the order in which a worker's executor runs
independent ops (by up to a quarter on these small configurations), and a device must hold the largest: hence the
largest over several steps. Everything the worker holds counts: its stages' variables and slots, the micro-batches it
receives, the schedule's stashes, the head's work on the last stage, and what TensorFlow keeps between steps there.

With `tensors`, more steps are traced with the TensorFlow profiler on every worker and "tensors" is the most bytes
the worker's tensors held at once in them (`tensors_peak`): the allocator's peak less the unused part of the
chunks it handed out whole, which depends on which chunks earlier steps left free.

One configuration per fresh process (`measure_in_fresh_process`): a client connects to one cluster once.

What holds a worker's peak: `--at_peak` also traces a step with the TensorFlow profiler on every worker and lists
the allocations alive at the moment its allocator held the most and at the moment its tensors did (what a plan
of the tensors must count), grouped by the op that made them:

  python -m bench.step_memory --model=image.amoebanet.AmoebaNetTinyOffline --at_peak \
      --params="task.network.num_stages=2,task.network.remat='always'"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def measure_step(model: str, gin: Sequence[str], overrides: str, steps: int = 6,
                 at_peak: bool = False, tensors: bool = False) -> dict[str, Any]:
    """Runs `steps` training steps of the configured experiment on faithful devices in this process (the module
    doc); {"measured": [bytes per device], "predicted": [the plan's peak per device], "plan": the plan}, and with
    `at_peak` "at_peak": [per device, `peak_allocations` of more traced steps], with `tensors` "tensors": [per
    device, `tensors_peak` of more traced steps, less the bytes held before the task was built].

    Call it once per process: the client connects to its workers' cluster for good.
    """
    import tensorflow as tf

    from gpipe_tf import experiment, workers
    from gpipe_tf.gpipe import placement
    from gpipe_tf.gpipe.pipeline import find_pipelines
    from gpipe_tf.memory.head import task_head
    from gpipe_tf.memory.plan import plan_pipeline
    from gpipe_tf.training.learner import Learner

    params, _ = experiment.resolve_params(model, gin_bindings=list(gin), overrides=overrides)
    pipe = dict(find_pipelines(params.task))["task.network"]
    plan = plan_pipeline(pipe, params.train, head=task_head(params.task, "task.network"))
    k = plan["num_devices"]
    with workers.LocalWorkers(k, memory=True, profiler=at_peak or tensors) as cluster:
        workers.connect(cluster.spec)
        placement.set_auto_kind("workers")
        before = [cluster.memory_info(t)["current"] for t in range(k)]
        task = params.task.instantiate()
        learner = Learner(task, params.train)
        batch = next(iter(params.input.train.instantiate().dataset()))

        def step() -> None:
            float(learner.train_step(batch, tf.constant(False))["loss"])  # float(): waits for the step

        step()
        for t in range(k):
            cluster.reset_memory_stats(t)
        for _ in range(steps - 1):
            step()
        measured = [cluster.memory_info(t)["peak"] - before[t] for t in range(k)]
        result = {"measured": measured, "predicted": [row["peak"] for row in plan["devices"]], "plan": plan}
        if at_peak or tensors:
            from bench import op_breakdown

            with op_breakdown.worker_traces(cluster.profiler_addresses, step, 3000, 0.5) as paths:
                events = [memory_events(path) for path in paths]
            if tensors:
                result["tensors"] = [tensors_peak(e) - before[t] for t, e in enumerate(events)]
            if at_peak:
                result["at_peak"] = [peak_allocations(e) for e in events]
                result["at_tensors_peak"] = [peak_allocations(e, tensors=True) for e in events]
    return result


MemoryEvent = tuple[int, bool, dict[str, Any]]  # (time in ps, an allocation (else a deallocation), its stats)


def memory_events(trace_path: str) -> list[MemoryEvent]:
    """The allocator's events of one worker's profiler trace (`*.xplane.pb`), in time order."""
    from bench.op_breakdown import read_space

    space = read_space(trace_path)
    events = []
    for plane in space.planes:
        names = {i: m.name for i, m in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = plane.event_metadata[event.metadata_id].name
                if kind in ("MemoryAllocation", "MemoryDeallocation"):
                    stats = {names.get(st.metadata_id): st.str_value or names.get(st.ref_value) or st.int64_value
                             or st.uint64_value for st in event.stats}
                    events.append((line.timestamp_ns * 1000 + event.offset_ps, kind == "MemoryAllocation", stats))
    return sorted(events, key=lambda e: e[0])


def tensors_peak(events: Sequence[MemoryEvent]) -> int:
    """The most bytes the worker's tensors held at once over the traced steps: after each event, the allocator's
    bytes in use less the unused part of the chunks alive that were handed out during the trace (BFC hands out a
    free chunk whole unless it is at least twice the request, so a chunk may hold up to twice its tensor, and how
    much depends on which chunks earlier steps left free)."""
    return max((held for held, _ in _held(events, tensors=True)), default=0)


Allocation = tuple[int, str, str, int]  # (chunk bytes, op, kind, requested bytes) of one traced allocation


def _held(events: Sequence[MemoryEvent], tensors: bool) -> Iterator[tuple[int, dict[Any, Allocation]]]:
    """After each event, (the allocator's bytes in use, or with `tensors` its tensors' bytes (`tensors_peak`), the
    traced allocations alive: addr -> `Allocation`, one dict updated in place)."""
    live: dict[Any, Allocation] = {}
    total_slack = 0
    for _, allocation, stats in events:
        addr = stats.get("addr")
        gone = live.pop(addr, None)
        total_slack -= gone[0] - gone[3] if gone else 0
        if allocation:
            live[addr] = (int(stats.get("allocation_bytes") or 0), str(stats.get("tf_op") or "?"),
                          str(stats.get("region_type") or "?"), int(stats.get("requested_bytes") or 0))
            total_slack += live[addr][0] - live[addr][3]
        yield int(stats.get("bytes_allocated") or 0) - (total_slack if tensors else 0), live


def peak_allocations(events: Sequence[MemoryEvent], top: int = 12, tensors: bool = False) -> dict[str, Any]:
    """The allocations alive when the allocator of one worker's trace (`memory_events`) held the most, or with
    `tensors` when its tensors did (`tensors_peak`): {"peak": bytes, "by_op": [[bytes, count, op name, kind], ...]
    largest first, `top` of them (bytes: the allocator's chunks, or with `tensors` the bytes requested; kind:
    "output" for an op's result, "temp" for its scratch memory), "traced": the allocator chunks' bytes of the
    step's allocations alive then, "requested": the bytes those allocations asked for}. The allocator (BFC) hands
    out a free chunk whole unless it is at least twice the request, so a chunk may hold up to twice its tensor."""
    peak, at = max(((held, i) for i, (held, _) in enumerate(_held(events, tensors))), default=(0, -1),
                   key=lambda e: e[0])  # the first event at the peak
    # Replayed to the peak, rather than copying the allocations alive at every new peak on the way.
    at_peak = next((live for i, (_, live) in enumerate(_held(events, tensors)) if i == at), {})
    groups: dict[tuple[str, str], list[int]] = {}
    for size, op, kind, requested in at_peak.values():
        group = groups.setdefault((op, kind), [0, 0])
        group[0] += requested if tensors else size
        group[1] += 1
    ranked = sorted(([b, n, op, kind] for (op, kind), (b, n) in groups.items()), reverse=True)
    return {"peak": peak, "by_op": ranked[:top], "traced": sum(a[0] for a in at_peak.values()),
            "requested": sum(a[3] for a in at_peak.values())}


def measure_in_fresh_process(model: str, gin: Sequence[str], overrides: str, steps: int = 6,
                             timeout: float = 1800, env: Mapping[str, str] | None = None,
                             tensors: bool = False) -> dict[str, Any]:
    """`measure_step` in a fresh Python process, with `env` added to this one's environment (its workers inherit
    it); raises RuntimeError with its stderr's tail if it fails."""
    job = json.dumps({"model": model, "gin": list(gin), "overrides": overrides, "steps": steps, "tensors": tensors})
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    done = subprocess.run([sys.executable, "-m", "bench.step_memory", job], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"measuring {model} with {overrides!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """One configuration from flags: each device's predicted and measured peak, and with --at_peak what holds it."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Registry key of the experiment.")
    parser.add_argument("--gin_param", action="append", default=[], help="A gin binding; repeatable.")
    parser.add_argument("--params", default="", help="Params overrides, as the trainer's --params.")
    parser.add_argument("--steps", type=int, default=6, help="Steps; the largest peak of all but the first is "
                        "measured (default 6).")
    parser.add_argument("--at_peak", action="store_true", help="List the allocations alive at each peak, the "
                        "allocator's and the tensors'.")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: at least 2 (the first step warms up)")
    result = measure_step(args.model, args.gin_param, args.params, args.steps, args.at_peak, tensors=args.at_peak)
    for d, (predicted, measured) in enumerate(zip(result["predicted"], result["measured"])):
        print(f"device {d}: predicted {predicted / 2 ** 20:.2f} MiB, measured {measured / 2 ** 20:.2f} MiB "
              f"({predicted / measured - 1:+.1%})")
        if "tensors" in result:
            tensors = result["tensors"][d]
            print(f"  its tensors' peak in the traced steps: {tensors / 2 ** 20:.2f} MiB "
                  f"({predicted / tensors - 1:+.1%})")
        if "at_peak" in result:
            at_peak = result["at_peak"][d]
            print(f"  the step's allocations alive at the allocator's peak: {at_peak['traced'] / 2 ** 20:.2f} MiB of "
                  f"allocator chunks for {at_peak['requested'] / 2 ** 20:.2f} MiB of tensors; the rest of the peak "
                  "was allocated before the step")
            for size, count, op, kind in at_peak["by_op"]:
                print(f"  {size / 2 ** 20:9.2f} MiB x{count:<4} {kind:<6} {op}")
            at_tensors = result["at_tensors_peak"][d]
            print(f"  the step's tensors alive at the tensors' peak: {at_tensors['requested'] / 2 ** 20:.2f} MiB")
            for size, count, op, kind in at_tensors["by_op"]:
                print(f"  {size / 2 ** 20:9.2f} MiB x{count:<4} {kind:<6} {op}")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # measure_in_fresh_process's job
        _job = json.loads(sys.argv[1])
        print(json.dumps(measure_step(_job["model"], _job["gin"], _job["overrides"], _job["steps"],
                                      tensors=_job["tensors"])))
    else:
        main()
