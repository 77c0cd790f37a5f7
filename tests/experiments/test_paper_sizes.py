"""Parameter counts of the GPipe paper's Transformer experiments, from Params alone (nothing is built)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from gpipe_tf.experiment import resolve_params
from gpipe_tf.inspection import inspect

TRANSFORMER_L = [("TransformerL_3", 282.2e6), ("TransformerL_13", 785.8e6), ("TransformerL_103", 5.3e9)]
LADDER = [
    ("T6_8192_16", 400e6),
    ("T24_8192_16", 1.3e9),
    ("T12_16384_32", 1.3e9),
    ("T32_16384_32", 3e9),
    ("T64_16384_32", 6e9),
]
# Exact counts of what TranslationTask builds: L * (encoder 20,988,928 + decoder 25,189,376) for H=8192, A=16,
# L * (41,971,712 + 50,369,536) for H=16384, A=32, plus 2 * 64,000 * 1,024 matrices (the source/target embedding
# shared, and the untied softmax) and the 64,000 softmax bias, 2 * 1,024 per final norm.
BUILT = {
    "T6_8192_16": 408_209_920, "T24_8192_16": 1_239_419_392, "T12_16384_32": 1_239_235_072,
    "T32_16384_32": 3_086_060_032, "T64_16384_32": 6_040_979_968,
}


@functools.cache
def _report(name: str) -> dict[str, Any]:
    params, _ = resolve_params(f"mt.gpipe_paper.{name}")
    return inspect(params)


@pytest.mark.parametrize("name,paper", TRANSFORMER_L)
def test_transformer_l_matches_table_1(name: str, paper: float) -> None:
    """Transformer-L counts within 0.5% of GPipe Table 1."""
    total = _report(name)["total_params"]
    assert abs(total - paper) <= 0.005 * paper, f"{name}: {total:,} vs {paper:,.0f}"


def test_transformer_l_per_layer_count() -> None:
    """Each extra layer adds exactly 50,358,272 parameters (4d^2+4d, FFN with biases, 2 layer norms)."""
    assert (_report("TransformerL_13")["total_params"] - _report("TransformerL_3")["total_params"]) == 10 * 50_358_272


@pytest.mark.parametrize("name,paper", LADDER)
def test_ladder_within_5_percent(name: str, paper: float) -> None:
    """Multilingual T(L, H, A) counts within 5% of 400M / 1.3B / 1.3B / 3B / 6B."""
    total = _report(name)["total_params"]
    assert abs(total - paper) <= 0.05 * paper, f"{name}: {total:,} vs {paper:,.0f}"


@pytest.mark.parametrize("name", sorted(BUILT))
def test_ladder_exact_built_count(name: str) -> None:
    """The count of what TranslationTask builds with 64-wide heads (guards head_dim reaching every layer)."""
    assert _report(name)["total_params"] == BUILT[name]


@pytest.mark.parametrize("name,stages", [("T6_8192_16", 1), ("T24_8192_16", 4), ("T12_16384_32", 2),
                                         ("T32_16384_32", 8), ("T64_16384_32", 16), ("TransformerL_3", 1),
                                         ("TransformerL_13", 1), ("TransformerL_103", 8)])
def test_stages_sum_to_at_most_total(name: str, stages: int) -> None:
    """inspect finds the pipeline with K stages whose parameters sum to at most the total (softmax is outside)."""
    report = _report(name)
    assert len(report["stages"]) == stages
    assert sum(s["params"] for s in report["stages"]) <= report["total_params"]


def test_ted_multi_big_is_t6() -> None:
    """TedMultiBig has the T(6, 8192, 16) size."""
    params, _ = resolve_params("mt.ted_multi.TedMultiBig")
    assert inspect(params)["total_params"] == BUILT["T6_8192_16"]
