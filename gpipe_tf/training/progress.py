"""Console progress of long phases: a start line, a line at most every few seconds, an end line with the duration.

Evaluation, decoding and the trainer's other long phases report through `Phase`, so a user always sees what the
process is doing and for how long; `--quiet` passes a log that drops these lines. The clock is injectable so that
tests can check the lines without depending on the machine's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]
# A progress line at most this often during a phase (seconds).
INTERVAL_SECS = 10.0


def format_duration(seconds: float) -> str:
    """`1h02m03s`, `2m03s` or `3s` (rounded to whole seconds); `0.4s` below 10 s keeps one decimal."""
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Phase:
    """Reports one phase of `total` items (None: unknown): `what: N unit ...`, then `what: done/total unit, T`
    at most every `interval_secs`, and `finish()` returns the phase's duration in seconds."""

    def __init__(self, log: Callable[[str], None], what: str, total: int | None, unit: str = "batches",
                 interval_secs: float = INTERVAL_SECS, clock: Clock = time.perf_counter) -> None:
        self.log = log
        self.what = what
        self.total = total
        self.unit = unit
        self.interval_secs = interval_secs
        self.clock = clock
        self.start = self._last = clock()
        self.log(f"{what}: {'?' if total is None else total} {unit} ...")

    def update(self, done: int) -> None:
        """Notes that `done` items are finished; prints a line if the last one is `interval_secs` old."""
        now = self.clock()
        if now - self._last >= self.interval_secs:
            total = "?" if self.total is None else self.total
            self.log(f"{self.what}: {done}/{total} {self.unit}, {format_duration(now - self.start)}")
            self._last = now

    def finish(self) -> float:
        """Seconds since the phase started."""
        return self.clock() - self.start
