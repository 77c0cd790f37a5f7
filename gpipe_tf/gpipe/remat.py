"""Rematerialization policies: which stages recompute their forward pass during the backward pass."""

from __future__ import annotations

from gpipe_tf.hyperparams import ParamsError

POLICIES = ("never", "always", "except_last")


def stage_uses_remat(policy: str, stage: int, num_stages: int) -> bool:
    """Whether `stage` recomputes under `policy`.

    always: every stage keeps only its input per micro-batch; except_last: all but the last stage, whose
    backward starts right after its forward in GPipe's schedule, so recomputing it would save nothing.
    """
    if policy not in POLICIES:
        raise ParamsError(f"remat={policy!r} is not one of {POLICIES}")
    return policy == "always" or (policy == "except_last" and stage < num_stages - 1)
