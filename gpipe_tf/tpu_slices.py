"""TPU slices: which cores a pipeline's K stages and D replicas get, from the slice's topology.

Lingvo's GPipe runs one XLA program per replica with stage k on the replica's logical core k; in TensorFlow 2 that
is a `TPUStrategy` built with a `tf.tpu.experimental.DeviceAssignment` of K cores per replica (lingvo/core/gpipe.py
and cluster.py; TensorFlow's `TPUStrategy` docs). Everything here works on a `tf.tpu.experimental.Topology`, which
can be built without a TPU, so the assignment a trainer would make on a slice can be computed, printed and tested
anywhere:

* `topology(name)`: the topology of a named slice (`SLICES`), as `initialize_tpu_system` would report it;
* `device_assignment(topology, K, D)`: D replicas of K cores each, the K cores of a replica as close as the mesh
  allows (the cores of one chip first, then neighbouring chips along x, y, z), with errors that name what fits;
* `stage_cores(assignment)`: replica r's stage k -> (chip coordinates, core on the chip, host task), and
  `format_stage_cores` the one table a trainer prints;
* `tpu_strategy(tpu, K, D)`: on a real slice, the `TPUStrategy` with that assignment (connects to the TPU and
  initializes it; without one, a `ConfigError` naming the TPU and what to pass).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from gpipe_tf.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice's shape: chips along x, y, z, TensorCores per chip as TensorFlow sees them, chips per host.

    Source: Google Cloud's TPU system architecture pages (v2, v3: 2 TensorCores per chip seen as 2 devices, 4
    chips per host; v4: 2 TensorCores per chip fused into one device (megacore), 4 chips per host, 3-D slices).
    """

    chips: tuple[int, int, int]
    cores_per_chip: int
    chips_per_host: int = 4

    @property
    def num_cores(self) -> int:
        """TensorFlow devices (TPU cores) in the slice."""
        return math.prod(self.chips) * self.cores_per_chip


SLICES = {
    "v2-8": Slice((2, 2, 1), 2),
    "v3-8": Slice((2, 2, 1), 2),
    "v3-32": Slice((4, 4, 1), 2),
    "v4-8": Slice((2, 2, 1), 1),
    "v4-32": Slice((2, 2, 4), 1),
}


def topology(name: str) -> tf.tpu.experimental.Topology:
    """The topology of slice `name` (a key of SLICES): hosts own blocks of chips_per_host chips, x fastest."""
    if name not in SLICES:
        raise ConfigError(f"TPU slice {name!r} is not one of {', '.join(SLICES)}; on a real slice the topology "
                          "comes from tf.tpu.experimental.initialize_tpu_system")
    s = SLICES[name]
    x, y, z = s.chips
    chips = [(i, j, k) for k in range(z) for j in range(y) for i in range(x)]
    per_host = min(s.chips_per_host, len(chips))
    hosts = [chips[h:h + per_host] for h in range(0, len(chips), per_host)]
    coordinates = np.array([[[*chip, core] for chip in host for core in range(s.cores_per_chip)]
                            for host in hosts], dtype=np.int32)
    return tf.tpu.experimental.Topology(mesh_shape=[x, y, z, s.cores_per_chip], device_coordinates=coordinates)


def computation_shape(mesh_shape: list[int], num_cores: int) -> list[int]:
    """The [x, y, z, core] block of `num_cores` cores for one replica: every core of a chip before the next chip,
    then chips along x, y and z, so that consecutive stages sit on one chip or on neighbouring chips."""
    x, y, z, cores = (int(d) for d in mesh_shape)
    candidates = [[a, b, c, d] for d in range(1, cores + 1) for a in range(1, x + 1) for b in range(1, y + 1)
                  for c in range(1, z + 1)
                  if a * b * c * d == num_cores and x % a == 0 and y % b == 0 and z % c == 0 and cores % d == 0]
    if not candidates:
        total = x * y * z * cores
        fits = sorted({a * b * c * d for a, b, c, d in itertools.product(
            _divisors(x), _divisors(y), _divisors(z), _divisors(cores))})
        raise ConfigError(f"{num_cores} cores per replica (the pipeline's K) do not tile this slice of {total} cores "
                          f"(mesh {x}x{y}x{z}, {cores} per chip); use a K from {fits}")
    # Fewest chips first (cores of one chip are closest), then the most compact block of chips.
    return min(candidates, key=lambda s: (-s[3], s[0] * s[1] * s[2], s[2], s[1]))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def device_assignment(topo: tf.tpu.experimental.Topology, num_stages: int,
                      num_replicas: int | None = None) -> tf.tpu.experimental.DeviceAssignment:
    """D replicas (default: as many as fit) of `num_stages` cores each on `topo`: replica r's logical core k runs
    stage k."""
    total = int(np.prod(topo.mesh_shape))
    if num_stages < 1:
        raise ConfigError(f"num_stages={num_stages} must be >= 1")
    shape = computation_shape(list(topo.mesh_shape), num_stages)
    most = total // num_stages
    replicas = most if num_replicas is None else num_replicas
    if not 1 <= replicas <= most:
        raise ConfigError(f"num_replicas={replicas} with num_stages={num_stages} needs {replicas * num_stages} cores; "
                          f"this slice has {total}: use num_replicas between 1 and {most}")
    return tf.tpu.experimental.DeviceAssignment.build(topo, computation_shape=shape, num_replicas=replicas)


@dataclasses.dataclass(frozen=True)
class StageCore:
    """Where one replica's stage runs: the chip's mesh coordinates, the core on the chip, the host task."""

    replica: int
    stage: int
    chip: tuple[int, int, int]
    core: int
    task: int


def stage_cores(assignment: tf.tpu.experimental.DeviceAssignment) -> list[StageCore]:
    """Every (replica, stage) of `assignment` with its core, replica-major."""
    out = []
    for r in range(assignment.num_replicas):
        for k in range(assignment.num_cores_per_replica):
            x, y, z, core = (int(c) for c in assignment.coordinates(r, k))
            task = int(assignment.topology.task_ordinal_at_coordinates([x, y, z, core]))
            out.append(StageCore(replica=r, stage=k, chip=(x, y, z), core=core, task=task))
    return out


def format_stage_cores(assignment: tf.tpu.experimental.DeviceAssignment) -> str:
    """One line per replica: 'replica r: stage k -> chip (x,y,z) core c host t, ...'."""
    by_replica: dict[int, list[str]] = {}
    for s in stage_cores(assignment):
        by_replica.setdefault(s.replica, []).append(
            f"stage {s.stage} -> chip ({s.chip[0]},{s.chip[1]},{s.chip[2]}) core {s.core} host {s.task}")
    return "\n".join(f"replica {r}: " + ", ".join(parts) for r, parts in sorted(by_replica.items()))


def tpu_strategy(tpu: str, num_stages: int, num_replicas: int | None = None,
                 log: Callable[[str], None] = print) -> tf.distribute.TPUStrategy:
    """Connects to TPU `tpu` (a name, a grpc:// address, or 'local' for the host's own TPU), initializes it and
    returns a `TPUStrategy` of D replicas (default: as many as fit) of `num_stages` cores each, replica r's logical
    core k for stage k (`device_assignment` on the slice's own topology); logs `format_stage_cores` first.

    Raises ConfigError, with the TPU's name and what to pass, where no TPU answers."""
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        topo = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, tf.errors.NotFoundError, tf.errors.UnavailableError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"no TPU answered at tpu={tpu!r} ({first[:160]}); pass the TPU's name or grpc:// address, "
                          "or 'local' on a TPU VM") from e
    assignment = device_assignment(topo, num_stages, num_replicas)
    log(format_stage_cores(assignment))
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)
