"""Tests of gpipe_tf.training.lr_schedules against plain Python formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.training import lr_schedules

STEPS = [0, 1, 7, 99, 100, 101, 499, 500, 999, 1000, 5000, 3_000_000_000]


def make(cls, **overrides):
    p = cls.params()
    for k, v in overrides.items():
        setattr(p, k, v)
    return p.instantiate()


def rsqrt_ref(step, warmup):
    return min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))


def cosine_ref(step, total, warmup, final):
    if step < warmup:
        return step / warmup
    progress = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


def step_ref(step, boundaries, factor, every_n):
    if not boundaries and every_n > 0:
        return factor ** (step // every_n)
    return factor ** sum(1 for b in boundaries if b <= step)


CASES = [
    ("constant", lr_schedules.Constant, {}, lambda s: 1.0),
    ("rsqrt", lr_schedules.LinearWarmupRsqrtDecay, {"warmup_steps": 100}, lambda s: rsqrt_ref(s, 100)),
    ("cosine", lr_schedules.Cosine, {"total_steps": 1000}, lambda s: cosine_ref(s, 1000, 0, 0.0)),
    ("cosine_warmup", lr_schedules.Cosine, {"total_steps": 1000, "warmup_steps": 100, "final_ratio": 0.1},
     lambda s: cosine_ref(s, 1000, 100, 0.1)),
    ("step_boundaries", lr_schedules.StepDecay, {"boundaries": [100, 500], "decay_factor": 0.5},
     lambda s: step_ref(s, [100, 500], 0.5, 0)),
    ("step_every_n", lr_schedules.StepDecay, {"every_n_steps": 100}, lambda s: step_ref(s, [], 0.1, 100)),
    ("step_off", lr_schedules.StepDecay, {}, lambda s: 1.0),
]


@pytest.mark.parametrize("name,cls,overrides,reference", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(name, cls, overrides, reference):
    schedule = make(cls, **overrides)
    want = np.array([reference(s) for s in STEPS], dtype=np.float32)
    eager = np.array([schedule(s).numpy() for s in STEPS])
    assert eager.dtype == np.float32
    np.testing.assert_allclose(eager, want, rtol=1e-6, atol=1e-30)

    traced = tf.function(schedule, autograph=False)
    in_graph = np.array([traced(tf.constant(s, tf.int64)).numpy() for s in STEPS])
    np.testing.assert_allclose(in_graph, want, rtol=1e-6, atol=1e-30)
    assert traced.experimental_get_tracing_count() == 1


def test_rsqrt_peaks_at_one_at_end_of_warmup():
    schedule = make(lr_schedules.LinearWarmupRsqrtDecay, warmup_steps=4000)
    assert schedule(3999).numpy() == pytest.approx(1.0)
    assert schedule(0).numpy() == pytest.approx(1 / 4000)
    assert schedule(15999).numpy() == pytest.approx(0.5)


def test_int32_step_tensor():
    schedule = make(lr_schedules.StepDecay, boundaries=[10])
    assert schedule(tf.constant(10, tf.int32)).numpy() == pytest.approx(0.1)


@pytest.mark.parametrize("cls,overrides,field", [
    (lr_schedules.LinearWarmupRsqrtDecay, {"warmup_steps": 0}, "warmup_steps"),
    (lr_schedules.LinearWarmupRsqrtDecay, {"warmup_steps": 10.5}, "warmup_steps"),
    (lr_schedules.Cosine, {"total_steps": 0}, "total_steps"),
    (lr_schedules.Cosine, {"total_steps": 100, "warmup_steps": 100}, "warmup_steps"),
    (lr_schedules.Cosine, {"warmup_steps": -1}, "warmup_steps"),
    (lr_schedules.Cosine, {"final_ratio": 1.5}, "final_ratio"),
    (lr_schedules.StepDecay, {"boundaries": [100, 100]}, "boundaries"),
    (lr_schedules.StepDecay, {"boundaries": [200, 100]}, "boundaries"),
    (lr_schedules.StepDecay, {"boundaries": [0]}, "boundaries"),
    (lr_schedules.StepDecay, {"boundaries": [True]}, "boundaries"),
    (lr_schedules.StepDecay, {"decay_factor": 0.0}, "decay_factor"),
    (lr_schedules.StepDecay, {"every_n_steps": -5}, "every_n_steps"),
    (lr_schedules.StepDecay, {"boundaries": [10], "every_n_steps": 5}, "every_n_steps"),
])
def test_validation_errors(cls, overrides, field):
    with pytest.raises(ParamsError) as info:
        make(cls, **overrides)
    message = str(info.value)
    assert f"{cls.__name__}.{field}=" in message
    assert repr(overrides[field]) in message
