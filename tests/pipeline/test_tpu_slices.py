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
