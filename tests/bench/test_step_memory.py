"""bench.step_memory's tensors' peak: the allocator's bytes in use less the unused part of the chunks it handed out
whole, from a worker's profiler trace."""

import json
import subprocess
import sys
import textwrap

from bench import step_memory
from tests.helpers.paths import ROOT

MIB = 2 ** 20


def _event(t: int, addr: int, in_use: int, chunk: int = 0, requested: int = 0) -> step_memory.MemoryEvent:
    stats = {"addr": addr, "bytes_allocated": in_use}
    if chunk:
        stats.update(allocation_bytes=chunk, requested_bytes=requested)
    return (t, bool(chunk), stats)


def test_tensors_peak_leaves_out_the_unused_part_of_chunks_handed_out_whole() -> None:
    base = 10 * MIB  # held before the trace: its chunks are not in the trace, so they count whole
    events = [
        _event(1, 0xA, base + 8 * MIB, chunk=8 * MIB, requested=5 * MIB),  # a 5 MiB tensor in a free 8 MiB chunk
        _event(2, 0xB, base + 12 * MIB, chunk=4 * MIB, requested=4 * MIB),  # the allocator's peak: 22 MiB
        _event(3, 0xA, base + 4 * MIB),  # the 5 MiB tensor freed
        _event(4, 0xC, base + 10 * MIB, chunk=6 * MIB, requested=6 * MIB),  # 10 MiB of tensors, no slack
    ]
    assert max(e[2]["bytes_allocated"] for e in events) == base + 12 * MIB
    assert step_memory.tensors_peak(events) == base + 10 * MIB


def test_tensors_peak_counts_a_reused_address_by_its_latest_chunk() -> None:
    events = [
        _event(1, 0xA, 8 * MIB, chunk=8 * MIB, requested=2 * MIB),
        _event(2, 0xA, 0),
        _event(3, 0xA, 8 * MIB, chunk=8 * MIB, requested=8 * MIB),  # the same chunk, now filled
    ]
    assert step_memory.tensors_peak(events) == 8 * MIB


def test_the_listing_at_the_tensors_peak_is_of_another_moment_than_the_allocators() -> None:
    def event(t: int, addr: int, in_use: int, chunk: int, requested: int, op: str) -> step_memory.MemoryEvent:
        stats = {"addr": addr, "bytes_allocated": in_use, "allocation_bytes": chunk, "requested_bytes": requested,
                 "tf_op": op, "region_type": "output"}
        return (t, True, stats)

    events = [
        event(1, 0xA, 16 * MIB, chunk=16 * MIB, requested=9 * MIB, op="Small"),  # allocator's peak: 16 MiB
        _event(2, 0xA, 0),
        event(3, 0xB, 12 * MIB, chunk=12 * MIB, requested=12 * MIB, op="Big"),  # tensors' peak: 12 MiB
    ]
    at_allocator = step_memory.peak_allocations(events)
    at_tensors = step_memory.peak_allocations(events, tensors=True)
    assert at_allocator["by_op"] == [[16 * MIB, 1, "Small", "output"]]
    assert at_tensors == {"peak": 12 * MIB, "by_op": [[12 * MIB, 1, "Big", "output"]], "traced": 12 * MIB,
                          "requested": 12 * MIB}


TRACE_SCRIPT = textwrap.dedent("""
    import json
    import tensorflow as tf
    from bench import op_breakdown, step_memory
    from gpipe_tf import workers

    with workers.LocalWorkers(1, memory=True, profiler=True) as cluster:
        devices = workers.connect(cluster.spec)
        with tf.device(devices[0]):
            v = tf.Variable(tf.ones([1024, 1024]))  # a variable: Grappler cannot fold the step into a constant

        @tf.function(autograph=False)
        def step():
            with tf.device(devices[0]):
                a = v * 2.0  # 4 MiB
                both = tf.concat([a, a], 0)  # 8 MiB, while a is alive: 12 MiB of tensors at once
                return tf.reduce_sum(both) + tf.reduce_sum(a)

        step().numpy()
        before = cluster.memory_info(0)["current"]
        with op_breakdown.worker_traces(cluster.profiler_addresses, lambda: step().numpy(), 2000, 0.1) as paths:
            events = step_memory.memory_events(paths[0])
        print(json.dumps({"tensors": step_memory.tensors_peak(events) - before,
                          "allocator": max(e[2]["bytes_allocated"] for e in events) - before}))
""")


def test_a_traced_workers_tensors_peak_holds_the_steps_tensors_and_no_more_than_its_allocator() -> None:
    out = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    # Less at most a few small tensors held before the trace and freed in it (the previous step's scalars: 256-byte
    # chunks), which depends on when the executor freed them.
    assert 12 * MIB - 64 * 1024 <= peaks["tensors"] <= peaks["allocator"], peaks
    assert peaks["tensors"] < 13 * MIB, peaks  # the step holds nothing else of size
