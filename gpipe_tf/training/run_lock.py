"""One trainer per logdir: an exclusive flock on the logdir itself, released by the kernel when the process ends.

A lock on the directory (not on a file in it) can be taken before anything is written, and a killed trainer never
leaves it stuck. The holder's pid is recorded in HOLDER_FILE, for the second trainer's message only.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

from gpipe_tf.errors import ConfigError

HOLDER_FILE = "trainer.pid"


class LogdirLock:
    """An exclusive, non-blocking lock on one logdir, held until `release` or the end of the process."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self._fd: int | None = None

    def acquire(self) -> None:
        """Locks the logdir (creating it if needed); ConfigError naming the holder if another trainer has it."""
        os.makedirs(self.logdir, exist_ok=True)
        fd = os.open(self.logdir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"--logdir={self.logdir!r} is in use by another trainer ({self._holder()}); wait for it "
                              "to finish or stop it, or use another --logdir") from None
        self._fd = fd

    def record_holder(self) -> None:
        """Writes this process's pid, host and start time into HOLDER_FILE (call once holding the lock)."""
        path = os.path.join(self.logdir, HOLDER_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        os.replace(path + ".tmp", path)

    def release(self) -> None:
        """Unlocks the logdir (the kernel also does it when the process ends)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _holder(self) -> str:
        try:
            with open(os.path.join(self.logdir, HOLDER_FILE), encoding="utf-8") as f:
                return f.read().strip() or "its pid is not recorded yet"
        except FileNotFoundError:
            return "its pid is not recorded yet"
