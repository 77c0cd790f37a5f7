"""Rematerialization policies: which stages recompute their forward pass during the backward pass."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

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


def _is_differentiable(t: tf.Tensor) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def rematerialize(fn: Callable[[Any, Any], Any], theta: Any, inputs: Any) -> Any:
    """Calls fn(theta, inputs) under `tf.recompute_grad`: its activations are recomputed in the backward pass.

    Weights come in as explicit tensors (closures over variables fail inside `tf.while_loop`). Integer inputs
    (ids, labels) pass by closure: they have no gradient, and `recompute_grad` differentiates all its arguments.
    """
    flat_theta = tf.nest.flatten(theta)
    flat_inputs = tf.nest.flatten(inputs)
    float_positions = [j for j, t in enumerate(flat_inputs) if _is_differentiable(t)]
    n_theta = len(flat_theta)
    structure: list[Any] = []

    def flat_fn(*args: tf.Tensor) -> list[tf.Tensor]:
        leaves = list(flat_inputs)
        for j, arg in zip(float_positions, args[n_theta:]):
            leaves[j] = arg
        out = fn(tf.nest.pack_sequence_as(theta, list(args[:n_theta])), tf.nest.pack_sequence_as(inputs, leaves))
        if not structure:
            structure.append(out)
        return tf.nest.flatten(out)

    flat_out = tf.recompute_grad(flat_fn)(*flat_theta, *[flat_inputs[j] for j in float_positions])
    return tf.nest.pack_sequence_as(structure[0], list(flat_out))
