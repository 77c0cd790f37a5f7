"""AmoebaNet cell genotypes A, B and D (paper_facts §1, from [TPU] model_specs).

State 0 is h[i-1] after the cell's 1x1 input conv, state 1 is h[i-2] after adjustment, states 2..6 are the block
outputs. Each block sums op_left(state) and op_right(state). The concatenated states are a fixed list (the
`used_hiddenstates` flags of [TPU]), not derived from which states the blocks read: A-normal concatenates state 1
although a block reads it.
"""

from __future__ import annotations

import dataclasses

from gpipe_tf.hyperparams import ParamsError


@dataclasses.dataclass(frozen=True)
class Block:
    """One block: op_left(state input_left) + op_right(state input_right)."""

    op_left: str
    input_left: int
    op_right: str
    input_right: int


@dataclasses.dataclass(frozen=True)
class CellGenotype:
    """The five blocks of a cell and the states its output concatenates."""

    blocks: tuple[Block, ...]
    concat: tuple[int, ...]


def _cell(blocks: list[tuple[str, int, str, int]], concat: list[int]) -> CellGenotype:
    return CellGenotype(tuple(Block(*b) for b in blocks), tuple(concat))


GENOTYPES: dict[str, dict[str, CellGenotype]] = {
    "A": {
        "normal": _cell([("avg3", 0, "max3", 0), ("sep3", 1, "id", 1), ("id", 0, "avg3", 1),
                         ("sep3", 0, "sep5", 2), ("avg3", 5, "sep3", 0)], [1, 3, 4, 6]),
        "reduction": _cell([("sep3", 1, "avg3", 0), ("max3", 0, "sep7", 2), ("max3", 1, "max3", 0),
                            ("sep3", 4, "c1x7_7x1", 0), ("avg3", 1, "sep7", 0)], [2, 3, 4, 5, 6]),
    },
    "B": {
        "normal": _cell([("c1x1", 1, "max3", 1), ("id", 1, "sep3", 0), ("c1x1", 1, "sep3", 0),
                         ("c1x1", 2, "id", 2), ("avg3", 1, "c1x1", 5)], [0, 3, 4, 6]),
        "reduction": _cell([("max2", 0, "max3", 0), ("id", 2, "c3x3", 1), ("dil2sep5", 2, "max3", 2),
                            ("id", 3, "sep3", 1), ("avg3", 4, "c1x1", 3)], [5, 6]),
    },
    "D": {
        "normal": _cell([("c1x1", 1, "max3", 1), ("id", 1, "c1x7_7x1", 0), ("c1x1", 0, "c1x7_7x1", 0),
                         ("max3", 2, "id", 2), ("avg3", 1, "c1x1", 5)], [0, 3, 4, 6]),
        "reduction": _cell([("max2", 0, "max3", 0), ("id", 2, "c3x3", 1), ("c1x7_7x1", 2, "max3", 2),
                            ("id", 3, "max2", 1), ("avg3", 2, "c1x1", 3)], [4, 5, 6]),
    },
}


def cell_genotype(genotype: str, reduction: bool) -> CellGenotype:
    """The normal or reduction cell of genotype 'A', 'B' or 'D'."""
    if genotype not in GENOTYPES:
        raise ParamsError(f"unknown AmoebaNet genotype {genotype!r}; expected one of {sorted(GENOTYPES)}")
    return GENOTYPES[genotype]["reduction" if reduction else "normal"]
