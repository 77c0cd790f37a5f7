"""`python trainer.py ...` for tests, started in a fraction of a second: `run` and `Popen` take the arguments of
`subprocess.run` and `subprocess.Popen` and fork the trainer from a process that has imported TensorFlow already
(`tests/helpers/trainer_zygote.py`, one per test process, started at the first trainer).

A trainer forked so is `python trainer.py` in everything a test reads: its own pid (signals reach it), the exit code
or signal, stdout and stderr as pipes, the working directory, the environment, and the interpreter's normal exit.
What it skips is the import of TensorFlow and of the trainer's modules, so a command takes the real-process path
whenever that import could differ:
* an environment whose start-up variables (TensorFlow's, oneDNN's, Python's, ...: `STARTUP_VARIABLES`) differ from
  those the zygote started with, e.g. a test's PYTHONPATH or TF_ENABLE_ONEDNN_OPTS;
* arguments the zygote does not carry (`preexec_fn` for resource limits, `input`, ...), or a command other than
  `sys.executable trainer.py ...`;
* `GPIPE_TESTS_REAL_PROCESSES=1` in the environment: every trainer a real process, to check that nothing depends
  on the zygote.
What TensorFlow prints while it loads is thus checked by the tests that start Python themselves
(tests/cli/test_tf_startup.py).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from tests.helpers.paths import ROOT

STARTUP_VARIABLES = ("TF_", "TPU_", "XLA_", "ONEDNN", "DNNL_", "MKL_", "OMP_", "KMP_", "CUDA", "NVIDIA", "PYTHON",
                     "LD_", "GRPC_", "GPIPE_")
_ZYGOTE_ARGUMENTS = {"cwd", "env", "stdout", "stderr", "text", "universal_newlines", "timeout", "capture_output",
                     "check"}
_zygote: _Zygote | None = None


def _startup_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARIABLES)}


class _Zygote:
    """The server process and the socket it listens on; killed when this process exits."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.dir = tempfile.mkdtemp(prefix="trainer-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.process = subprocess.Popen([sys.executable, "-m", "tests.helpers.trainer_zygote", self.path], cwd=ROOT,
                                        env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        ready = self.process.stdout.readline()
        if ready != b"ready\n":
            self.process.kill()
            raise RuntimeError(f"the trainer zygote did not start (said {ready!r}, exit {self.process.wait()}); "
                               "its error is above. GPIPE_TESTS_REAL_PROCESSES=1 runs trainers without it")
        atexit.register(self.close)

    def serves(self, command: list[str], cwd: str | None, env: dict[str, str] | None, other: dict) -> bool:
        """Whether `command` with these arguments runs as it would in a process of its own (the module doc)."""
        trainer = os.path.join(ROOT, "trainer.py")
        return (len(command) >= 2 and command[0] == sys.executable
                and os.path.abspath(os.path.join(cwd or os.getcwd(), command[1])) == trainer
                and {k for k, v in other.items() if v is not None} <= _ZYGOTE_ARGUMENTS
                and self.process.poll() is None
                and _startup_environment(os.environ if env is None else env) == _startup_environment(self.env))

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _get_zygote() -> _Zygote | None:
    global _zygote
    if os.environ.get("GPIPE_TESTS_REAL_PROCESSES") == "1":
        return None
    if _zygote is None:
        _zygote = _Zygote()
    return _zygote


def _child_end(spec: Any, fd: int) -> tuple[int, int | None]:
    """(descriptor for the trainer, our read end or None) for a subprocess-style stdout/stderr argument."""
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        return write, read
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY), None
    if spec is None:
        return os.dup(fd), None
    if isinstance(spec, int):
        return os.dup(spec), None
    return os.dup(spec.fileno()), None


class ForkedTrainer:
    """The part of `subprocess.Popen` tests use (pid, stdout, stderr, wait, poll, communicate, send_signal, kill),
    for a trainer forked by the zygote."""

    def __init__(self, zygote: _Zygote, command: list[str], cwd: str | None, env: dict[str, str] | None,
                 stdout: Any, stderr: Any, text: bool) -> None:
        self.args = command
        self.returncode: int | None = None
        ends = [(os.open(os.devnull, os.O_RDONLY), None), _child_end(stdout, 1)]
        ends.append((os.dup(ends[1][0]), None) if stderr == subprocess.STDOUT else _child_end(stderr, 2))
        request = {"argv": command[1:], "cwd": os.path.abspath(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env)}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(zygote.path)
            socket.send_fds(self._conn, [json.dumps(request).encode()], [child for child, _ in ends])
        finally:
            for child, _ in ends:
                os.close(child)
        mode = "r" if text else "rb"
        self.stdin = None
        self.stdout = None if ends[1][1] is None else open(ends[1][1], mode)  # noqa: SIM115 - closed by communicate
        self.stderr = None if ends[2][1] is None else open(ends[2][1], mode)  # noqa: SIM115
        self._buffer = b""
        self.pid = json.loads(self._read_line(None))["pid"]
        self._readers: list[threading.Thread] = []
        self._output: dict[str, Any] = {}

    def _read_line(self, timeout: float | None) -> bytes | None:
        """The watcher's next reply, or None if none came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], remaining)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the trainer zygote's watcher of pid {self.pid} went away without its status")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is None:
                return None
            self.returncode = os.waitstatus_to_exitcode(json.loads(line)["status"])
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), None while it runs."""
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the trainer; `subprocess.TimeoutExpired` after `timeout` seconds."""
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        """Sends `sig` to the trainer unless it has ended."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Reads stdout and stderr to their end and waits, as `subprocess.Popen.communicate`."""
        if not self._readers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    reader = threading.Thread(target=lambda s=stream, n=name: self._output.__setitem__(n, s.read()),
                                              daemon=True)
                    reader.start()
                    self._readers.append(reader)
        for reader in self._readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                stream.close()
        return self._output.get("stdout"), self._output.get("stderr")

    def __enter__(self) -> ForkedTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        if self.returncode is None:
            self.wait()


def Popen(command: list[str], **kwargs: Any) -> Any:  # noqa: N802 - named after what it stands in for
    """`subprocess.Popen(command, **kwargs)`; a trainer forked from the zygote where it runs the same (module doc)."""
    zygote = _get_zygote()
    if zygote is None or not zygote.serves(command, kwargs.get("cwd"), kwargs.get("env"), kwargs):
        return subprocess.Popen(command, **kwargs)
    return ForkedTrainer(zygote, command, kwargs.get("cwd"), kwargs.get("env"), kwargs.get("stdout"),
                          kwargs.get("stderr"), bool(kwargs.get("text") or kwargs.get("universal_newlines")))


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(command, **kwargs)`; a trainer forked from the zygote where it runs the same (module doc)."""
    zygote = _get_zygote()
    if zygote is None or not zygote.serves(command, kwargs.get("cwd"), kwargs.get("env"), kwargs):
        return subprocess.run(command, **kwargs)
    if kwargs.get("capture_output"):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    process = Popen(command, **{k: v for k, v in kwargs.items() if k not in ("timeout", "capture_output", "check")})
    with process:
        try:
            out, err = process.communicate(timeout=kwargs.get("timeout"))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
    result = subprocess.CompletedProcess(command, process.returncode, out, err)
    if kwargs.get("check"):
        result.check_returncode()
    return result
