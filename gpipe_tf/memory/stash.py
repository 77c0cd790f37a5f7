"""How many micro-batches' stashes each pipeline stage holds at once, by schedule: the one place the planner reads
a schedule's order (so that it can read the schedules' own order data once they state it)."""

from __future__ import annotations

from gpipe_tf.errors import ConfigError

SCHEDULE_NAMES = ("fill_drain", "unrolled", "one_f_one_b", "interleaved")


def stashed_micro_batches(schedule_name: str, num_devices: int, num_micro_batches: int,
                          virtual_stages: int = 1) -> list[int]:
    """Micro-batches each of the v*K pipeline stages holds stashed at its peak (forward done, backward not).

    FillDrain and Unrolled run every forward before any backward: M on every stage. 1F1B: stage k starts
    micro-batch i only after its backward of i - (K - k), so min(M, K - k). Interleaved: the 1F1B loop over
    the v*K pipeline stages, stage s holding min(M, vK - s) (`one_f_one_b.py`, `interleaved.py`).
    """
    k, m, v = num_devices, num_micro_batches, virtual_stages
    if schedule_name in ("fill_drain", "unrolled"):
        return [m] * k
    if schedule_name == "one_f_one_b":
        return [min(m, k - s) for s in range(k)]
    if schedule_name == "interleaved":
        return [min(m, v * k - s) for s in range(v * k)]
    raise ConfigError(f"schedule {schedule_name!r} is unknown to the memory planner; use one of {SCHEDULE_NAMES}")
