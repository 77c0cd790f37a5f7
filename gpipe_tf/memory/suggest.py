"""The smallest change that makes a pipeline fit its devices' memory, found by re-planning each candidate.

Candidates, in the order a user would rather accept them (same numerics and devices first):
1F1B (same math, stage k holds K - k micro-batches), more micro-batches (same math, smaller stashes),
remat 'always' (about a third more compute), bfloat16 compute (other numerics), more stages (more devices).
Each is planned with `plan.plan_pipeline`; the first whose predicted peak leaves HEADROOM of the budget free (the
model's error against measured peaks, docs/memory.md) is the suggestion. If no single change does, pairs of changes
are tried in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.batch_shapes import rescaled_micro_batch_shape
from gpipe_tf.hyperparams import InstantiableParams, Params
from gpipe_tf.memory.head import NO_HEAD, Head
from gpipe_tf.memory.plan import plan_pipeline, schedule_order

Change = tuple[str, dict[str, Any]]  # (description, {field: value} on the pipeline Params)
HEADROOM = 0.15  # a suggestion's predicted peak stays below (1 - HEADROOM) x the budget


def _micro_batch_changes(pipe: InstantiableParams) -> list[Change]:
    out = []
    for factor in (2, 4, 8):
        m = pipe.num_micro_batches * factor
        smaller = rescaled_micro_batch_shape(pipe.micro_batch_shape, pipe.num_micro_batches, m)
        if smaller is not None:
            out.append((f"num_micro_batches={m}", {"num_micro_batches": m, "micro_batch_shape": smaller}))
    return out


def candidate_changes(pipe: InstantiableParams) -> list[list[Change]]:
    """Groups of alternative single changes, in order of preference (see the module doc)."""
    groups: list[list[Change]] = []
    if schedule_order(pipe).in_flight is None:  # every forward before any backward: 1F1B bounds the stashes
        groups.append([("schedule 1F1B", {"schedule": "one_f_one_b"})])
    groups.append(_micro_batch_changes(pipe))
    if pipe.remat != "always":
        groups.append([("remat='always'", {"remat": "always"})])
    if (pipe.fprop_dtype or pipe.dtype or "float32") == "float32":
        groups.append([("fprop_dtype='bfloat16'", {"fprop_dtype": "bfloat16"})])
    stages = []
    k = pipe.num_stages
    while k * 2 <= len(pipe.layers):
        k *= 2
        stages.append((f"num_stages={k}", {"num_stages": k, "balance": None}))
    groups.append(stages)
    return [g for g in groups if g]


def _apply(pipe: InstantiableParams, changes: list[Change]) -> InstantiableParams:
    new = pipe.copy()
    for _, fields in changes:
        new.set(**fields)
    return new


def suggest(pipe: InstantiableParams, train: Params, device_memory: int, path: str = "task.network",
            planner: Callable[..., dict[str, Any]] = plan_pipeline, head: Head = NO_HEAD) -> dict[str, Any] | None:
    """The first candidate (single changes, then pairs) whose predicted peak is within (1 - HEADROOM) x
    `device_memory` on every device, the task's loss `head` included: {"change", "params" (the --params text),
    "max_peak"}; None if none is."""
    groups = candidate_changes(pipe)
    singles = [[c] for group in groups for c in group]
    # Pairs: one change from each of two groups (e.g. 1F1B with remat), in order of preference.
    pairs = [[a, b] for g1, g2 in itertools.combinations(groups, 2) for a in g1 for b in g2]
    for changes in singles + pairs:
        candidate = _apply(pipe, changes)
        try:
            plan = planner(candidate, train, path, device_memory, head=head)
        except (ConfigError, ValueError):
            continue  # e.g. more stages than the balance allows: not a candidate
        if plan["max_peak"] <= (1 - HEADROOM) * device_memory:
            text = ",".join(f"{path}.{key}={value!r}" for _, fields in changes for key, value in fields.items())
            return {"change": " and ".join(d for d, _ in changes), "params": text, "max_peak": plan["max_peak"]}
    return None


def describe(hint: dict[str, Any] | None, target: str) -> str:
    """`suggest`'s result as the end of a one-line message: the change and its --params text, or that none fits
    `target` (e.g. "--device_memory=16GiB")."""
    if hint is None:
        return f"no single change or pair of changes fits {target}: more devices or a smaller model"
    return f"smallest change that fits {target}: {hint['change']} (--params={hint['params']})"
