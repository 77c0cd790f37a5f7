"""The tiers: a grid's default sample keeps its corners and covers every pair of values; `--tier` splits the
collected tests into the default and exhaustive tiers without losing or repeating one."""

import itertools
import os
import subprocess
import sys

import pytest

from tests.helpers import tiers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AXES = dict(schedule=["fill_drain", "one_f_one_b", "zero_bubble"], remat=["never", "always"], k=[1, 2, 3, 4],
            m=[1, 2, 4, 8])


def test_the_default_sample_keeps_every_corner_and_covers_every_pair():
    cases = tiers.default_cases(AXES, corners=("schedule", "remat", "k"))
    assert len(set(cases)) == len(cases) < len(list(itertools.product(*AXES.values())))
    for schedule, remat, k in itertools.product(AXES["schedule"], AXES["remat"], (1, 4)):
        assert any(c[:3] == (schedule, remat, k) for c in cases), (schedule, remat, k)
    names = list(AXES)
    for (a, b) in itertools.combinations(range(len(names)), 2):
        for va, vb in itertools.product(AXES[names[a]], AXES[names[b]]):
            assert any(c[a] == va and c[b] == vb for c in cases), (names[a], va, names[b], vb)
    assert tiers.default_cases(AXES, corners=("schedule", "remat", "k")) == cases  # the same on every run


def test_grid_marks_what_the_default_sample_leaves_out():
    params = tiers.grid(corners=("k",), **AXES)
    kept = {tuple(p.values) for p in params if not p.marks}
    assert kept == set(tiers.default_cases(AXES, corners=("k",)))
    assert all(p.marks == (tiers.EXHAUSTIVE,) for p in params if tuple(p.values) not in kept)
    assert len(params) == len(list(itertools.product(*AXES.values())))
    with pytest.raises(ValueError, match=r"corners \['n'\] are not axes of the grid"):
        tiers.grid(corners=("n",), **AXES)


def test_a_one_axis_grid_keeps_every_value_unless_it_is_a_corner():
    assert tiers.default_cases(dict(k=[1, 2, 3])) == [(1,), (2,), (3,)]
    assert tiers.default_cases(dict(k=[1, 2, 3]), corners=("k",)) == [(1,), (3,)]


class _Item:
    """What `conftest._in_tier` reads of a collected test: its closest `exhaustive` mark."""

    def __init__(self, exhaustive):
        self.mark = pytest.mark.exhaustive.mark if exhaustive else None

    def get_closest_marker(self, name):
        return self.mark if name == "exhaustive" else None


def test_each_test_is_in_exactly_one_of_the_default_and_exhaustive_tiers_and_all_holds_both():
    from tests.conftest import TIERS, _in_tier

    assert set(TIERS) == {"default", "exhaustive", "all"}
    for exhaustive in (False, True):
        item = _Item(exhaustive)
        assert [_in_tier(item, tier) for tier in ("default", "exhaustive", "all")] == [not exhaustive, exhaustive, True]


def _collected(tier):
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", f"--tier={tier}",
                             "tests/pipeline/test_batched_weights.py"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return {line for line in result.stdout.splitlines() if "::" in line}


@pytest.mark.exhaustive(covered_by=(
    "tests/suite/test_tiers.py::test_each_test_is_in_exactly_one_of_the_default_and_exhaustive_tiers_and_all_holds_both",
    "tests/suite/test_tiers.py::test_grid_marks_what_the_default_sample_leaves_out",
))
def test_the_default_and_exhaustive_tiers_split_the_tests_between_them():
    default, exhaustive, every = _collected("default"), _collected("exhaustive"), _collected("all")
    assert default and exhaustive and not default & exhaustive
    assert default | exhaustive == every
    assert all("[" in name for name in exhaustive)  # only cases of grids leave this module's default tier


def test_ci_runs_the_exhaustive_tier_and_the_linter():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        lines = [line.strip() for line in f if not line.lstrip().startswith("#")]
    assert ".venv/bin/python -m pytest -q -n 2 --tier=exhaustive" in lines
    assert any(line.endswith(".venv/bin/ruff check .") for line in lines)


def _whole_test_marks():
    """{(file, test name): covered_by} of every test function marked `exhaustive` as a whole, read from the source:
    `@pytest.mark.exhaustive(covered_by=(...))` (None where the mark names nothing)."""
    import ast
    import glob

    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if ast.unparse(target) == "pytest.mark.exhaustive":
                    keywords = {k.arg: k.value for k in getattr(deco, "keywords", [])}
                    covered = ast.literal_eval(keywords["covered_by"]) if "covered_by" in keywords else None
                    found[(os.path.relpath(path, ROOT), node.name)] = covered
    return found


def test_a_test_moved_whole_to_the_exhaustive_tier_names_default_tests_that_cover_its_behaviour():
    marks = _whole_test_marks()
    assert marks, "no test is marked exhaustive as a whole: the check below would check nothing"
    problems = []
    for (path, name), covered in marks.items():
        if not covered:
            problems.append(f"{path}::{name}: give covered_by=(...), the default-tier tests of its behaviour")
            continue
        for node in covered:
            file, _, test = node.partition("::")
            source = os.path.join(ROOT, file)
            if not os.path.exists(source) or f"\ndef {test}(" not in open(source, encoding="utf-8").read():
                problems.append(f"{path}::{name}: covered_by names {node}, which does not exist")
            elif (file, test) in marks:
                problems.append(f"{path}::{name}: covered_by names {node}, itself in the exhaustive tier")
    assert not problems, "\n".join(problems)


class _FileItem(_Item):
    """A collected test of file `path`, starting a process or not (its `slow` mark)."""

    def __init__(self, path, slow):
        super().__init__(False)
        self.fspath = type("Path", (), {"strpath": path})()
        self.slow = slow

    def get_closest_marker(self, name):
        return pytest.mark.slow.mark if name == "slow" and self.slow else None


def test_files_are_ordered_heaviest_first_keeping_each_files_order():
    from tests.conftest import _heaviest_files_first

    items = [_FileItem("a.py", False), _FileItem("a.py", False), _FileItem("b.py", True), _FileItem("c.py", False),
             _FileItem("b.py", False)]
    expected = [items[2], items[4], items[0], items[1], items[3]]
    _heaviest_files_first(items)
    assert items == expected
