"""Test tiers: large parameter grids run in full in the exhaustive tier and as a covering sample by default.

`grid(...)` returns every combination of the given axes as `pytest.param`s; those outside the default sample carry
the `exhaustive` mark, which `tests/conftest.py` leaves to `--tier=exhaustive` (or `--tier=all`). The default
sample is deterministic (no random draw, so a failure names the same cases on every machine):

* every combination of the `corners` axes, numeric axes at their extremes (e.g. every schedule x remat x K in
  {1, 4}), each completed with the other axes' values that cover the most value pairs not yet covered;
* then, until every pair of values of any two axes appears in some case, the case that covers most of the pairs
  still missing (a greedy pairwise covering array), the first such case in product order on a tie.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest

EXHAUSTIVE = pytest.mark.exhaustive


def _extremes(values: Sequence[Any]) -> list[Any]:
    """A numeric axis's smallest and largest value; every value of another axis."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sorted({min(values), max(values)})
    return list(values)


def _pairs(case: tuple) -> set[tuple]:
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(range(len(case)), 2)}


def default_cases(axes: dict[str, Sequence[Any]], corners: Sequence[str] = ()) -> list[tuple]:
    """The default tier's cases of the grid `axes` (see the module doc), in product order."""
    names = list(axes)
    unknown = [c for c in corners if c not in axes]
    if unknown:
        raise ValueError(f"corners {unknown} are not axes of the grid {names}")
    product = list(itertools.product(*axes.values()))
    missing = set().union(*(_pairs(case) for case in product)) if len(names) > 1 else set()
    chosen: list[tuple] = []

    def take(candidates: list[tuple]) -> None:
        best = max(candidates, key=lambda case: (len(_pairs(case) & missing), -product.index(case)))
        chosen.append(best)
        missing.difference_update(_pairs(best))

    if len(names) == 1 and not corners:
        return product  # nothing to pair and no corner asked for: every value
    positions = [names.index(c) for c in corners]
    for corner in (itertools.product(*(_extremes(axes[c]) for c in corners)) if corners else ()):
        take([case for case in product if case not in chosen
              and all(case[p] == v for p, v in zip(positions, corner))])
    while missing:
        take([case for case in product if case not in chosen])
    return sorted(chosen, key=product.index)


def _id(case: tuple) -> str:
    return "-".join("-".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in case)


def grid(corners: Sequence[str] = (), **axes: Sequence[Any]) -> list[Any]:
    """Every combination of `axes` as a `pytest.param` (values in the axes' order, id 'a-b-...'), marked
    `exhaustive` unless it is one of `default_cases(axes, corners)`. Use with `parametrize(",".join(axes), ...)`."""
    keep = set(default_cases(axes, corners))
    return [pytest.param(*case, id=_id(case), marks=() if case in keep else EXHAUSTIVE)
            for case in itertools.product(*axes.values())]


def sample(cases: Sequence[Any], keep: Sequence[Any], ids: Sequence[str] | None = None, *,
           single: bool = False) -> list[Any]:
    """Hand-listed `cases` (tuples for several arguments, else single values; with `single`, every case is one
    argument, tuples too) as `pytest.param`s, those not in `keep` marked `exhaustive`: a fault or a dtype tried in
    several variants keeps its `keep` ones by default."""
    unknown = [case for case in keep if case not in cases]
    if unknown:
        raise ValueError(f"kept cases {unknown} are not among the cases {list(cases)}")
    if ids is not None and len(ids) != len(cases):
        raise ValueError(f"{len(ids)} ids for {len(cases)} cases: give one id per case")
    params = []
    for j, case in enumerate(cases):
        values = case if isinstance(case, tuple) and not single else (case,)
        name = ids[j] if ids is not None else _id(values)
        params.append(pytest.param(*values, id=name, marks=() if case in keep else EXHAUSTIVE))
    return params
