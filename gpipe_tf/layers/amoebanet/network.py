"""AmoebaNet as a flat layer list for GPipe: stem, cells, head ([TPU] rules, paper_facts §4).

The list is [ConvStem, (2 stem cells,) N normal, reduction, N normal, reduction, N normal, ClassifierHead]. The stem
takes NHWC images and returns a pair, each cell maps (h[i-1], h[i-2]) to (h[i], h[i-1]), and the head maps the
last pair to logits, so any contiguous split of the list is a valid pipeline stage.
"""

from __future__ import annotations

import dataclasses

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.amoebanet.cells import Cell
from gpipe_tf.layers.amoebanet.conv import output_size
from gpipe_tf.layers.amoebanet.head import ClassifierHead
from gpipe_tf.layers.amoebanet.stem import ConvStem

STEMS = ("imagenet", "cifar")


@dataclasses.dataclass
class _Hidden:
    """What the next cell needs to know about h[i-1] or h[i-2]: channels and how often it was halved."""

    channels: int
    level: int


def _cell_plan(num_cells_per_stack: int, filters: int, stem: str) -> list[tuple[int, bool]]:
    """(fs, reduction) per cell, in order."""
    # [TPU]: stem cells use the reduction genotype at F/4 and F/2; each later reduction doubles F first.
    plan = [(int(filters * scale), True) for scale in (0.25, 0.5)] if stem == "imagenet" else []
    for stack in range(3):
        if stack:
            plan.append((filters * 2 ** stack, True))
        plan += [(filters * 2 ** stack, False)] * num_cells_per_stack
    return plan


def amoebanet_layers(genotype: str, num_cells_per_stack: int, filters: int, num_classes: int, image_size: int,
                     stem: str = "imagenet", *, stem_filters: int = 32, image_channels: int = 3,
                     dropout_rate: float = 0.5, drop_path_keep_prob: float = 1.0, drop_path_burn_in_steps: int = 0,
                     drop_path_depth_scaling: bool = True) -> list[InstantiableParams]:
    """AmoebaNet-`genotype` (A, B or D) with 3 * N normal cells and F filters, as a list of layer Params.

    Args:
      genotype: 'A', 'B' or 'D'.
      num_cells_per_stack: N, normal cells per stack (the papers' 18 cells are N=6).
      filters: F, the first stack's filters; each reduction cell doubles them.
      num_classes: logits of the head ([TPU] ImageNet: 1001); 0: the head returns pooled features.
      image_size: input height and width (checked against the stem's VALID 3x3 window).
      stem: 'imagenet' (3x3 conv stride 2 + BN, then 2 reduction-genotype stem cells at F/4 and F/2) or 'cifar'
        (3x3 conv stride 1 + BN, no stem cells).
      stem_filters: channels of the stem conv (32 in [TPU]).
      image_channels: channels of the input images.
      dropout_rate: dropout before the head's linear layer.
      drop_path_keep_prob: drop path keep probability of the last cell; 1.0 turns drop path off.
      drop_path_burn_in_steps: steps over which drop path ramps in (see drop_path.py); 0: from the start.
      drop_path_depth_scaling: cell k of T keeps with 1 - (k + 1) / T * (1 - keep_prob), deeper cells dropping
        more (as NASNet's ScheduledDropPath); False: every cell uses drop_path_keep_prob.

    Returns:
      Layer Params, unnamed so that the container (Sequential, GPipe) names them layer_0, layer_1, ...
    """
    if stem not in STEMS:
        raise ParamsError(f"stem={stem!r} is not one of {STEMS}")
    if num_cells_per_stack < 1 or filters < 1:
        raise ParamsError(f"num_cells_per_stack and filters must be >= 1, got {num_cells_per_stack} and {filters}")
    stride = 2 if stem == "imagenet" else 1
    output_size(image_size, 3, stride, "VALID")  # raises for an image smaller than the stem's 3x3 window
    plan = _cell_plan(num_cells_per_stack, filters, stem)
    layers = [ConvStem.params().set(input_dim=image_channels, filters=stem_filters, stride=stride)]
    prev, skip = _Hidden(stem_filters, 0), None
    for k, (fs, reduction) in enumerate(plan):
        keep = drop_path_keep_prob
        if drop_path_depth_scaling:
            keep = 1.0 - (k + 1) / len(plan) * (1.0 - drop_path_keep_prob)
        if skip is None:
            mode, skip_dim = "none", 0
        else:
            mode, skip_dim = ("reduce" if skip.level < prev.level else "same"), skip.channels
        cell = Cell.params().set(genotype=genotype, reduction=reduction, filters=fs, input_dim=prev.channels,
                                 skip_dim=skip_dim, skip_mode=mode, drop_path_keep_prob=keep,
                                 drop_path_burn_in_steps=drop_path_burn_in_steps)
        try:
            Cell.num_params(cell)  # validates every child's Params (e.g. even factorized-reduction widths)
        except ParamsError as e:
            raise ParamsError(f"AmoebaNet-{genotype} (N={num_cells_per_stack}, F={filters}) cell {k}: {e}") from None
        layers.append(cell)
        prev, skip = _Hidden(Cell.output_dim(cell), prev.level + reduction), prev
    layers.append(ClassifierHead.params().set(input_dim=prev.channels, num_classes=num_classes,
                                              dropout_rate=dropout_rate))
    return layers
