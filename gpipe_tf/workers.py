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
    """

    def __init__(self, num_workers: int, threads: int = 1, profiler: bool = False) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self.num_workers = num_workers
        self.threads = threads
        ports = free_ports(2 * num_workers if profiler else num_workers)
        self.addresses = [f"127.0.0.1:{port}" for port in ports[:num_workers]]
        self.profiler_addresses = [f"127.0.0.1:{port}" for port in ports[num_workers:]]
        self.processes: list[subprocess.Popen] = []

    @property
    def spec(self) -> dict[str, list[str]]:
        """The cluster dict of these workers."""
        return cluster_spec(self.addresses)

    def start(self) -> LocalWorkers:
        """Starts every server process; returns once all accept connections (or raises)."""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        for task in range(self.num_workers):
            profiler_port = self.profiler_addresses[task].split(":")[1] if self.profiler_addresses else "0"
            cmd = [sys.executable, "-m", "gpipe_tf.workers", json.dumps(self.spec), str(task), str(self.threads),
                   profiler_port]
            self.processes.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        deadline = time.time() + 60
        for address, proc in zip(self.addresses, self.processes):
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


def _serve(spec_json: str, task: int, threads: int, profiler_port: int = 0) -> None:
    # oneDNN kernels, as the trainer chooses them (gpipe_tf/trainer_main.py says why); before TensorFlow starts.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    import tensorflow as tf  # noqa: PLC0415 -- after the line above: TensorFlow reads the variable as it loads

    if profiler_port:
        tf.profiler.experimental.server.start(profiler_port)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads)
    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(spec_json)), job_name=JOB, task_index=task,
                                  config=config, start=True)
    server.join()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
