"""TPU slices without a TPU: device assignments of K cores per replica built from constructed topologies, where each
stage lands, and the errors when K or D does not fit the slice."""

import pytest

from gpipe_tf import tpu_slices
from gpipe_tf.errors import ConfigError


def neighbours(a, b):
    """Same chip, or chips one step apart along one mesh axis."""
    return sum(abs(p - q) for p, q in zip(a.chip, b.chip)) <= 1


@pytest.mark.parametrize("name,k,d", [("v3-8", 8, 1), ("v3-8", 4, 2), ("v3-8", 2, 4), ("v3-8", 1, 8),
                                      ("v4-32", 16, 1), ("v4-32", 8, 2), ("v4-32", 4, 4), ("v4-32", 2, 8)])
def test_every_core_runs_one_stage_of_one_replica_and_stages_are_neighbours(name, k, d):
    assignment = tpu_slices.device_assignment(tpu_slices.topology(name), k, d)
    assert (assignment.num_replicas, assignment.num_cores_per_replica) == (d, k)
    cores = tpu_slices.stage_cores(assignment)
    assert [(c.replica, c.stage) for c in cores] == [(r, s) for r in range(d) for s in range(k)]
    used = {(c.chip, c.core) for c in cores}
    assert len(used) == len(cores) == tpu_slices.SLICES[name].num_cores  # each core once: the slice is full
    for r in range(d):
        stages = cores[r * k:(r + 1) * k]
        assert all(neighbours(a, b) for a, b in zip(stages, stages[1:])), stages
    assert len(tpu_slices.format_stage_cores(assignment).splitlines()) == d


def test_two_stages_share_a_v3_chip_and_four_v4_stages_share_a_host():
    v3 = tpu_slices.stage_cores(tpu_slices.device_assignment(tpu_slices.topology("v3-8"), 2, 4))
    for r in range(4):
        first, second = v3[2 * r], v3[2 * r + 1]
        assert first.chip == second.chip and (first.core, second.core) == (0, 1)
    v4 = tpu_slices.stage_cores(tpu_slices.device_assignment(tpu_slices.topology("v4-32"), 4, 4))
    for r in range(4):
        assert len({c.task for c in v4[4 * r:4 * r + 4]}) == 1  # a replica's boundary transfers stay on one host
    assert {c.task for c in v4} == {0, 1, 2, 3}


def test_the_default_replica_count_fills_the_slice():
    assignment = tpu_slices.device_assignment(tpu_slices.topology("v4-32"), 4)
    assert assignment.num_replicas == 4


def test_sizes_that_do_not_fit_name_what_does():
    v38 = tpu_slices.topology("v3-8")
    with pytest.raises(ConfigError, match=r"3 cores per replica .* do not tile this slice of 8 cores \(mesh 2x2x1, 2 "
                                          r"per chip\); use a K from \[1, 2, 4, 8\]"):
        tpu_slices.device_assignment(v38, 3)
    with pytest.raises(ConfigError, match=r"num_replicas=3 with num_stages=4 needs 12 cores; this slice has 8: use "
                                          r"num_replicas between 1 and 2"):
        tpu_slices.device_assignment(v38, 4, 3)
    with pytest.raises(ConfigError, match=r"TPU slice 'v9-8' is not one of v2-8, v3-8"):
        tpu_slices.topology("v9-8")


def test_the_strategy_gets_the_slices_own_assignment_and_logs_it(monkeypatch):
    """TensorFlow's TPU calls stood in for (no TPU here): the strategy is built on the topology the TPU system
    reports, with K cores per replica, and the stage table is logged first."""
    import tensorflow as tf

    made = {}
    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", lambda tpu: ("resolver", tpu))
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda resolver: made.update(connect=resolver))
    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", lambda resolver: tpu_slices.topology("v3-8"))
    monkeypatch.setattr(tf.distribute, "TPUStrategy",
                        lambda resolver, experimental_device_assignment: (resolver, experimental_device_assignment))
    lines = []
    resolver, assignment = tpu_slices.tpu_strategy("my-tpu", num_stages=4, log=lines.append)
    assert resolver == ("resolver", "my-tpu") and made["connect"] == resolver
    assert (assignment.num_replicas, assignment.num_cores_per_replica) == (2, 4)
    assert lines == [tpu_slices.format_stage_cores(assignment)] and lines[0].startswith("replica 0: stage 0 -> chip")


def test_without_a_tpu_the_strategy_names_the_tpu_and_what_to_pass():
    """A process of its own: connecting to a cluster changes the process's TensorFlow context."""
    import subprocess
    import sys

    code = ("from gpipe_tf import tpu_slices\n"
            "try:\n    tpu_slices.tpu_strategy('local', 2)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert out.startswith("ConfigError no TPU answered at tpu='local' ("), out
    assert "pass the TPU's name or grpc:// address, or 'local' on a TPU VM" in out
