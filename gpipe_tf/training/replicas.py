"""Data parallelism over pipeline replicas: how many run where, and tf.distribute's all-reduce between them.

D replicas of a K-stage pipeline train on one global batch: replica g takes the g-th of D equal slices, runs its
pipeline on its own K devices (`placement.replica_stage_devices`) and the replicas' gradients, losses, metrics and
batch-norm statistics are reduced with TensorFlow's own cross-device machinery:

* one process (`train.num_replicas` = D): a `tf.distribute.MirroredStrategy` over the replicas' first-stage
  devices; its cross-device ops reduce (NCCL all-reduce between GPUs, `ReductionToOneDevice` between CPUs);
* several processes (TF_CONFIG, one replica per process, its pipeline on that host's devices):
  `tf.distribute.MultiWorkerMirroredStrategy`, whose collective all-reduce crosses hosts over gRPC (or NCCL).

The replicas' weights are the model's one set of variables per process: each process applies the same reduced
update, so they stay equal; at start-up every worker takes the chief's values (`broadcast_from_chief`), so a
worker that could not read the checkpoint still resumes at the chief's step. Only the chief writes checkpoints
and summaries.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.pipeline import GPipe


@dataclasses.dataclass
class ReplicaLayout:
    """Where this process stands among the data-parallel replicas of a run."""

    local_replicas: int = 1
    num_workers: int = 1
    worker_index: int = 0
    strategy: tf.distribute.Strategy | None = None
    home_devices: list[str] = dataclasses.field(default_factory=list)

    def attach_devices(self, home_devices: Sequence[str]) -> None:
        """Records each local replica's first-stage device; one process with D > 1 gets its MirroredStrategy."""
        devices = list(home_devices)
        if len(devices) != self.local_replicas:
            raise ConfigError(f"got {len(devices)} replica devices for {self.local_replicas} local replicas")
        self.home_devices = devices
        if self.strategy is None and self.local_replicas > 1:
            if len(set(devices)) != self.local_replicas:
                raise ConfigError(f"train.num_replicas={self.local_replicas} needs a distinct first-stage device per "
                                  f"replica, got {devices}; give the run num_replicas x num_stages devices "
                                  "(--logical_devices)")
            # Between GPUs the strategy's default (NCCL all-reduce). Between logical CPUs a reduction on the first
            # one: MirroredStrategy's CPU collectives share group keys across strategies, so a second layout in the
            # same process (tests, benchmarks) would join the first one's full group.
            on_cpu = all("CPU" in d.upper().rsplit("/", 1)[-1] for d in devices)
            ops = tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0]) if on_cpu else None
            self.strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=ops)

    @property
    def num_replicas(self) -> int:
        """D: replicas across all processes."""
        return self.local_replicas * self.num_workers

    @property
    def first_replica(self) -> int:
        """Global index of this process's local replica 0."""
        return self.worker_index * self.local_replicas

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and summaries (worker 0)."""
        return self.worker_index == 0

    def describe(self) -> str:
        """One line for the log: D, workers and this process's part."""
        where = f"worker {self.worker_index} of {self.num_workers}, " if self.num_workers > 1 else ""
        return f"data parallel: {self.num_replicas} replicas ({where}{self.local_replicas} in this process)"

    def all_reduce(self, op: tf.distribute.ReduceOp, per_replica: Sequence[Sequence[tf.Tensor]]
                   ) -> list[tf.Tensor]:
        """Reduces position-wise over every replica of the run; `per_replica[r]` is local replica r's list.

        Returns the reduced tensors as seen by local replica 0 (each placed where its replica-0 value was).
        """
        if self.num_replicas == 1:
            return list(per_replica[0])
        if self.strategy is None:
            raise RuntimeError(f"{self.local_replicas} local replicas but no strategy: call attach_devices() first")
        if len(per_replica) != self.local_replicas:
            raise ValueError(f"got values of {len(per_replica)} replicas; this process runs {self.local_replicas}")
        if not per_replica[0]:
            return []
        placed = []
        for r, values in enumerate(per_replica):
            # Cross-device reduction needs to know where each value is; unplaced ones go to the replica's home.
            with tf.device(self.home_devices[r] if self.home_devices else None):
                placed.append([v if getattr(v, "device", "") else tf.identity(v) for v in values])
        first = self.first_replica
        values = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: placed[ctx.replica_id_in_sync_group - first])
        # One batched reduction per dtype and set of devices (e.g. each pipeline stage's gradients):
        # tf.distribute packs a batch into few collectives only when its values share their destinations.
        groups: dict[tuple, list[int]] = {}
        for i, v in enumerate(values):
            parts = self.strategy.experimental_local_results(v)
            key = (parts[0].dtype.name, *(t.device for t in parts))  # packing concatenates: one dtype per batch
            groups.setdefault(key, []).append(i)
        out: list[tf.Tensor | None] = [None] * len(values)
        for indices in groups.values():
            reduced = self.strategy.extended.batch_reduce_to(op, [(values[i], values[i]) for i in indices])
            for i, r in zip(indices, reduced):
                out[i] = self.strategy.experimental_local_results(r)[0]
        return out

    def check_agreement(self, settings: Mapping[str, int]) -> None:
        """Raises ConfigError unless every worker runs with the same `settings` (e.g. train.max_steps).

        Workers that disagree would wait for each other's collectives forever; this finds out at start-up.
        """
        if self.num_workers == 1 or not settings:
            return
        names = sorted(settings)
        mine = tf.constant([float(settings[n]) for n in names], tf.float64)

        @tf.function(autograph=False)
        def moments() -> list[tf.Tensor]:
            parts = [[mine, tf.square(mine)]] + [[tf.zeros_like(mine)] * 2] * (self.local_replicas - 1)
            return self.all_reduce(tf.distribute.ReduceOp.SUM, parts)

        total, total_sq = (t.numpy() for t in moments())
        # All equal exactly when n * sum(v^2) == (sum v)^2, which every worker computes alike.
        differing = [n for j, n in enumerate(names) if abs(self.num_workers * total_sq[j] - total[j] ** 2) > 1e-6]
        if differing:
            raise ConfigError(f"the workers of this run disagree on {', '.join(differing)} (this worker: "
                              f"{', '.join(f'{n}={settings[n]}' for n in differing)}); start every worker with the "
                              "same flags and Params")

    def broadcast_from_chief(self, variables: Sequence[tf.Variable]) -> None:
        """Sets every worker's `variables` to the chief's values (a sum in which the other workers add zero)."""
        if self.num_workers == 1 or not variables:
            return

        @tf.function(autograph=False)
        def broadcast() -> None:
            keep = tf.constant(self.is_chief)
            mine = [tf.where(keep, v.read_value(), tf.zeros_like(v)) for v in variables]
            # Each local replica holds the same values; only replica 0's count.
            parts = [mine] + [[tf.zeros_like(v) for v in variables] for _ in range(self.local_replicas - 1)]
            for v, value in zip(variables, self.all_reduce(tf.distribute.ReduceOp.SUM, parts)):
                v.assign(value)

        broadcast()


def _cluster_from_env() -> tuple[int, int] | None:
    """(number of workers, this worker's index) from TF_CONFIG, or None when it is unset or names one worker."""
    text = os.environ.get("TF_CONFIG")
    if not text:
        return None
    try:
        config = json.loads(text)
        workers = config["cluster"]["worker"]
        task = config["task"]
        index = int(task["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"TF_CONFIG={text!r} is not a tf.distribute cluster config ({e}); expected "
                          '{"cluster": {"worker": ["host:port", ...]}, '
                          '"task": {"type": "worker", "index": i}}') from None
    if task.get("type", "worker") != "worker" or not 0 <= index < len(workers):
        raise ConfigError(f"TF_CONFIG task {task!r} must be a worker with 0 <= index < {len(workers)}")
    return (len(workers), index) if len(workers) > 1 else None


def write_tf_config(worker_hosts: Sequence[str], task_index: int) -> None:
    """Sets TF_CONFIG for a cluster of `worker_hosts` (host:port each) with this process as `task_index`."""
    if not worker_hosts or not 0 <= task_index < len(worker_hosts):
        raise ConfigError(f"--task_index={task_index} must be between 0 and {len(worker_hosts) - 1} "
                          f"(the number of --worker_hosts minus one)")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(worker_hosts)},
                                          "task": {"type": "worker", "index": task_index}})


def make_layout(local_replicas: int, use_cluster: bool = True) -> ReplicaLayout:
    """The layout of this process: `local_replicas` here, and the workers TF_CONFIG names (if several).

    With several workers this creates the MultiWorkerMirroredStrategy, which starts this process's server: call it
    before any other TensorFlow op. One process with D > 1 gets its MirroredStrategy in `attach_devices`, once the
    pipelines have chosen their devices.
    """
    if local_replicas < 1:
        raise ConfigError(f"train.num_replicas={local_replicas} must be >= 1")
    cluster = _cluster_from_env() if use_cluster else None
    if cluster is None:
        return ReplicaLayout(local_replicas=local_replicas)
    num_workers, index = cluster
    if local_replicas != 1:
        raise ConfigError(f"train.num_replicas={local_replicas} with TF_CONFIG: a multi-worker run holds one "
                          "pipeline replica per process; start one process per replica")
    # One replica per worker, on GPU hosts too: left alone, the strategy would make every visible GPU a replica,
    # while here a worker's GPUs are its pipeline's stages.
    gpus = tf.config.list_physical_devices("GPU")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec(), task_type="worker", task_id=index,
        num_accelerators={"GPU": 1} if gpus else {}, rpc_layer="grpc")
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    if strategy.num_replicas_in_sync != num_workers:
        raise ConfigError(f"the multi-worker strategy has {strategy.num_replicas_in_sync} replicas for "
                          f"{num_workers} workers; expected one replica per worker (TF_CONFIG)")
    return ReplicaLayout(local_replicas=1, num_workers=num_workers, worker_index=index, strategy=strategy)


def replica_home_devices(task: tf.Module, local_replicas: int) -> list[str]:
    """Each local replica's first-stage device: that of the task's pipelines, else device r of the default kind.

    Every pipeline of the task must have been built for `local_replicas` replicas (inside
    `placement.replicas(local_replicas)`).
    """
    pipes = [m for m in task.submodules if isinstance(m, GPipe)]
    for pipe in pipes:
        if len(pipe.replica_devices) != local_replicas:
            raise ConfigError(f"pipeline {pipe.path} was built for {len(pipe.replica_devices)} replicas, the run has "
                              f"{local_replicas} (train.num_replicas / --num_replicas); build the task inside "
                              "gpipe_tf.gpipe.placement.replicas(train.num_replicas)")
    if pipes:
        return [devices[0] for devices in pipes[0].replica_devices]
    return [devices[0] for devices in placement.replica_stage_devices(local_replicas, 1, "auto")]
