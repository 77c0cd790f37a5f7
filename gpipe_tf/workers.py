"""TF worker processes: stages on `/job:worker/replica:0/task:k`, locally (faithful CPU devices) or on hosts.

Logical CPUs in one process share one thread pool, so they cannot show whether a pipeline schedule overlaps
work. K single-thread `tf.distribute.Server` processes on 127.0.0.1 can: each is a device with its own core,
and transfers between stages are real gRPC transfers. The same placement spans hosts when the cluster lists
remote addresses. docs/benchmarks.md measures schedules this way; docs/scaling_out.md runs a cluster.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

JOB = "worker"
_PR_SET_PDEATHSIG = 1


def free_ports(count: int) -> list[int]:
    """`count` free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    # A worker blocked in join() would outlive a crashed client; the kernel kills it when the parent dies.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def cluster_spec(addresses: Sequence[str]) -> dict[str, list[str]]:
    """A cluster dict {'worker': [host:port, ...]} for `tf.train.ClusterSpec`."""
    return {JOB: list(addresses)}


class LocalWorkers:
    """K TF servers on 127.0.0.1, one process and `threads` compute threads each; a context manager.

    With `profiler`, each server also runs a TensorFlow profiler server (`profiler_addresses`, one per worker), so
    that `tf.profiler.experimental.client.trace` can record what each worker's executor runs, op by op.

    With `memory`, each server runs TensorFlow's BFC allocator on its CPU and answers `memory_info` and
    `reset_memory_stats` about it: the client cannot read a remote device's allocator (`get_memory_info` rejects
    remote devices), so each worker reads its own and sends the figures over a small socket of its own.
    """

    def __init__(self, num_workers: int, threads: int = 1, profiler: bool = False, memory: bool = False) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self.num_workers = num_workers
        self.threads = threads
        ports = free_ports(num_workers * (1 + profiler + memory))
        self.addresses = [f"127.0.0.1:{port}" for port in ports[:num_workers]]
        extra = iter(ports[num_workers:])
        self.profiler_addresses = [f"127.0.0.1:{next(extra)}" for _ in range(num_workers)] if profiler else []
        self.memory_addresses = [f"127.0.0.1:{next(extra)}" for _ in range(num_workers)] if memory else []
        self.processes: list[subprocess.Popen] = []

    @property
    def spec(self) -> dict[str, list[str]]:
        """The cluster dict of these workers."""
        return cluster_spec(self.addresses)

    def start(self) -> LocalWorkers:
        """Starts every server process; returns once all accept connections (or raises)."""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        if self.memory_addresses:
            env["TF_CPU_ALLOCATOR_USE_BFC"] = "1"  # the allocator whose figures get_memory_info reports on a CPU
        for task in range(self.num_workers):
            profiler_port = self.profiler_addresses[task].split(":")[1] if self.profiler_addresses else "0"
            memory_port = self.memory_addresses[task].split(":")[1] if self.memory_addresses else "0"
            cmd = [sys.executable, "-m", "gpipe_tf.workers", json.dumps(self.spec), str(task), str(self.threads),
                   profiler_port, memory_port]
            self.processes.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        deadline = time.time() + 60
        waits = list(zip(self.addresses, self.processes)) + list(zip(self.memory_addresses, self.processes))
        for address, proc in waits:
            host, port = address.split(":")
            while True:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
                    self.stop()
                    raise RuntimeError(f"worker {address} exited with {proc.returncode}: {err}")
                try:
                    socket.create_connection((host, int(port)), timeout=0.5).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        self.stop()
                        raise RuntimeError(f"worker {address} did not start within 60 s") from None
                    time.sleep(0.1)
        return self

    def stop(self) -> None:
        """Terminates every server (SIGTERM, then SIGKILL after 5 s)."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes = []

    def memory_info(self, task: int) -> dict[str, int]:
        """Worker `task`'s allocator: {"current": bytes in use, "peak": the most since the last reset}."""
        return self._ask_memory(task, "info")

    def reset_memory_stats(self, task: int) -> None:
        """Makes worker `task`'s peak start again from its current bytes."""
        self._ask_memory(task, "reset")

    def _ask_memory(self, task: int, command: str) -> dict[str, int]:
        if not self.memory_addresses:
            raise RuntimeError("these workers were started without memory=True, so they do not report memory")
        host, port = self.memory_addresses[task].split(":")
        with socket.create_connection((host, int(port)), timeout=60) as conn:
            conn.sendall(f"{command}\n".encode())
            reply = json.loads(conn.makefile().readline())
        if "error" in reply:
            raise RuntimeError(f"worker {task} could not report memory: {reply['error']}")
        return reply

    def __enter__(self) -> LocalWorkers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def connect(spec: dict[str, list[str]], inter_op_threads: int = 1) -> list[str]:
    """Connects this process to the cluster; returns the workers' CPU device names, task order.

    Workers adopt the client's inter-op setting, so it is set here, before connecting (it cannot change later).
    """
    # Deferred: this module is also the worker process's main, which sets TF_ENABLE_ONEDNN_OPTS before TensorFlow
    # loads (_serve); and the trainer imports it before TensorFlow starts.
    import tensorflow as tf  # noqa: PLC0415

    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec))
    return [f"/job:{JOB}/replica:0/task:{k}/device:CPU:0" for k in range(len(spec[JOB]))]


def _memory_channel(port: int) -> None:
    """Answers "info" and "reset" about this process's CPU allocator, one request per connection, until the end."""
    import tensorflow as tf  # noqa: PLC0415 -- the worker process has loaded it already

    listener = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = listener.accept()
        with conn:
            command = conn.makefile().readline().strip()
            if not command:  # LocalWorkers.start checking that the port is open
                continue
            try:
                if command == "reset":
                    tf.config.experimental.reset_memory_stats("CPU:0")
                    reply: dict = {}
                elif command == "info":
                    reply = dict(tf.config.experimental.get_memory_info("CPU:0"))
                else:
                    reply = {"error": f"unknown command {command!r}; known: info, reset"}
            except (ValueError, tf.errors.OpError) as e:  # sent to the client, which raises it
                reply = {"error": str(e)}
            conn.sendall((json.dumps(reply) + "\n").encode())


def _serve(spec_json: str, task: int, threads: int, profiler_port: int = 0, memory_port: int = 0) -> None:
    # oneDNN kernels, as the trainer chooses them (gpipe_tf/trainer_main.py says why); before TensorFlow starts.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    import tensorflow as tf  # noqa: PLC0415 -- after the line above: TensorFlow reads the variable as it loads

    if profiler_port:
        tf.profiler.experimental.server.start(profiler_port)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads)
    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(spec_json)), job_name=JOB, task_index=task,
                                  config=config, start=True)
    if memory_port:
        # The process-wide CPU allocator, which the server's device uses too
        # (docs/memory.md#checked-against-measured-peaks).
        threading.Thread(target=_memory_channel, args=(memory_port,), daemon=True).start()
    server.join()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *(int(a) for a in sys.argv[4:6]))
