"""A warning when every gradient of a pipeline stage is exactly zero for several steps in a row.

Such a stage's weights stop training while the run goes on and its loss may still fall (the other stages learn):
only a grad_norm curve would show it. In float16 without loss scaling (or with a scale too small) it is underflow:
float16 rounds magnitudes below about 6e-8 to zero, and the small activation gradients of early stages get there
(docs/precision.md#float16-and-loss-scaling). In any precision it also means that nothing of the loss reaches the
stage (a dead ReLU layer, a stop_gradient).

The learner reports, per step, which gradients are all zero (`Learner.train_step`'s `zero_gradients` mask); the
controller feeds the mask to `ZeroGradientWatch`, which groups the variables by stage and warns once per stage when
its gradients were all zero for `STEPS_IN_A_ROW` steps in a row (a skipped non-finite step breaks the row), and
again only after a step with a non-zero gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tensorflow as tf

from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.hyperparams import Params
from gpipe_tf.layers.base_layer import BaseLayer
from gpipe_tf.training import checkpoints

# Steps in a row with every gradient of a stage exactly zero before the warning: more than a zero-initialized output
# layer gives the stages before it (one step: the layer is non-zero after its first update).
STEPS_IN_A_ROW = 5
# At most this many variable names of a stage in the warning.
_NAMES_SHOWN = 2


@dataclass(frozen=True)
class StageGradients:
    """A stage (or the variables outside every pipeline) as the watch sees it."""

    name: str  # e.g. 'stage 0 of classifier/network'
    indices: tuple[int, ...]  # positions of its variables in the learner's variables_to_train
    float16: bool  # one of its layers computes in float16


def stages_of(task: tf.Module, variables: Sequence[tf.Variable]) -> list[StageGradients]:
    """`variables` grouped by the pipeline stage that owns them (partition-table order), then those outside every
    pipeline ('the layers outside the pipeline', or 'the model' for a task without one); groups without variables
    are left out."""
    pipes = [task] if isinstance(task, GPipe) else []
    pipes += [m for m in task.submodules if isinstance(m, GPipe)]
    position = {v.ref(): i for i, v in enumerate(variables)}
    owners = {v.ref(): m for m in (task, *task.submodules) if isinstance(m, BaseLayer) for v in m.vars.values()}
    groups: list[tuple[str, list[int]]] = []
    taken: set[int] = set()
    for pipe in pipes:
        for stage, names in enumerate(pipe.stage_layers):
            found = [position[v.ref()] for n in names for v in pipe.children[n].trainable_variables
                     if v.ref() in position and position[v.ref()] not in taken]
            taken.update(found)
            groups.append((f"stage {stage} of {pipe.path}", found))
    groups.append(("the layers outside the pipeline" if pipes else "the model",
                   [i for i in range(len(variables)) if i not in taken]))

    def computes_in_float16(indices: list[int]) -> bool:
        return any(owners[variables[i].ref()].fprop_dtype == tf.float16 for i in indices
                   if variables[i].ref() in owners)

    return [StageGradients(name, tuple(sorted(indices)), computes_in_float16(indices))
            for name, indices in groups if indices]


def fix_for(stage: StageGradients, loss_scale_method: str, loss_scale: Params) -> str:
    """What to do about `stage`'s zero gradients, given the run's loss scaling ('none', 'fixed' or 'dynamic', and
    the train.loss_scale Params)."""
    if not stage.float16:
        return ("nothing of the loss reaches it: look for a dead activation (ReLU units that never fire), a "
                "stop_gradient or a zero loss weight")
    underflow = "its float16 gradients underflow (magnitudes below 6e-8 round to zero)"
    if loss_scale_method == "none":
        return (f"{underflow} as the run computes in float16 without loss scaling: turn it on, "
                "--params=train.loss_scale.method=dynamic (docs/precision.md#float16-and-loss-scaling)")
    if loss_scale_method == "fixed":
        return (f"{underflow} at the fixed loss scale {loss_scale.initial_scale:g}: raise "
                "train.loss_scale.initial_scale, or set train.loss_scale.method=dynamic "
                "(docs/precision.md#float16-and-loss-scaling)")
    return (f"{underflow} at the dynamic loss scale: start it higher (train.loss_scale.initial_scale="
            f"{loss_scale.initial_scale:g}) or let it grow sooner (train.loss_scale.growth_interval="
            f"{loss_scale.growth_interval}) (docs/precision.md#float16-and-loss-scaling)")


class ZeroGradientWatch:
    """Counts, per stage, the applied steps in a row whose gradients were all exactly zero; `observe` returns the
    warning lines to print."""

    def __init__(self, stages: Sequence[StageGradients], variable_names: Sequence[str], loss_scale_method: str,
                 loss_scale: Params, steps_in_a_row: int = STEPS_IN_A_ROW) -> None:
        self.stages = list(stages)
        self.variable_names = list(variable_names)
        self.loss_scale_method = loss_scale_method
        self.loss_scale = loss_scale
        self.steps_in_a_row = steps_in_a_row
        self._zero_since = [0] * len(self.stages)  # per stage: steps in a row with zero gradients so far

    def observe(self, step: int, zero: Sequence[bool]) -> list[str]:
        """Takes the `zero_gradients` mask of applied step `step` (over the learner's variables_to_train); returns a
        warning for each stage whose gradients were all zero for exactly `steps_in_a_row` steps in a row now."""
        warnings = []
        for k, stage in enumerate(self.stages):
            if not all(zero[i] for i in stage.indices):
                self._zero_since[k] = 0
                continue
            self._zero_since[k] += 1
            if self._zero_since[k] == self.steps_in_a_row:
                warnings.append(self._warning(stage, step))
        return warnings

    def _warning(self, stage: StageGradients, step: int) -> str:
        shown = checkpoints.listed([self.variable_names[i] for i in stage.indices], _NAMES_SHOWN)
        first = step - self.steps_in_a_row + 1
        return (f"warning: every gradient of {stage.name} ({shown}) was exactly zero in steps {first}-{step} "
                f"({self.steps_in_a_row} in a row), so its weights do not train: "
                f"{fix_for(stage, self.loss_scale_method, self.loss_scale)}")
