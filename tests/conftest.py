"""Test session set-up: 4 logical CPU devices, configured before any test initializes TensorFlow; the slow marker;
the tiers (`--tier`)."""

import inspect

import pytest

from gpipe_tf import devices

NUM_LOGICAL_DEVICES = 4
devices.split_cpu(NUM_LOGICAL_DEVICES)


# --------------------------------------------------------------------------------------------- the slow marker
_STARTS_A_PROCESS = ("subprocess.", "sys.executable", "multiprocessing.")


def _starts_a_process(source: str, spawners: set[str]) -> bool:
    return any(token in source for token in _STARTS_A_PROCESS) or any(f"{name}(" in source for name in spawners)


def _module_spawners(module) -> set[str]:
    """Names of the module's functions and fixtures that start a process, directly or through another one."""
    cached = getattr(module, "_slow_spawners", None)
    if cached is not None:
        return cached
    sources = {}
    for name, value in vars(module).items():
        fn = getattr(value, "__wrapped__", value)
        if inspect.isfunction(fn) and fn.__module__ == module.__name__:
            sources[name] = inspect.getsource(fn)
    spawners: set[str] = set()
    while True:
        found = {name for name, source in sources.items() if name not in spawners
                 and _starts_a_process(source, spawners)}
        if not found:
            break
        spawners |= found
    module._slow_spawners = spawners
    return spawners


# --------------------------------------------------------------------------------------------------- the tiers
TIERS = {
    "default": "every test but those marked exhaustive (the README's test command)",
    "exhaustive": "only the tests marked exhaustive: the full grids (.ci/run runs it after the default tier)",
    "all": "every test",
}


def pytest_addoption(parser):
    parser.addoption("--tier", default="default", choices=sorted(TIERS),
                     help="which tier of tests to run: " + "; ".join(f"{k}: {v}" for k, v in TIERS.items()))


def _in_tier(item, tier: str) -> bool:
    exhaustive = item.get_closest_marker("exhaustive") is not None
    return tier == "all" or exhaustive == (tier == "exhaustive")


def pytest_collection_modifyitems(config, items):
    """Marks `slow` every test that starts a process (a trainer, a TF worker, TensorBoard, pip), itself or through
    a helper or fixture of its module: `pytest -m "not slow"` runs the in-process tests alone in a few minutes.
    Then keeps the tests of the tier `--tier` names (docs/contributing.md#the-tiers)."""
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        spawners = _module_spawners(item.module)
        source = inspect.getsource(getattr(function, "__wrapped__", function))
        if _starts_a_process(source, spawners) or spawners & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    tier = config.getoption("tier")
    kept = [item for item in items if _in_tier(item, tier)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if not _in_tier(item, tier)])
        items[:] = kept
    _heaviest_files_first(items)


# Rough costs in seconds: a test that starts a process (a TensorFlow import, a trace, a few steps) and an in-process
# test (most trace a small graph; many only check Params or arithmetic).
_PROCESS_COST, _IN_PROCESS_COST = 15.0, 0.25


def _heaviest_files_first(items) -> None:
    """Orders the files by their estimated cost, heaviest first, each file's tests in their own order: xdist hands
    each worker whole files in this order (`--dist loadfile`), so the last files, which one worker may run while the
    other waits, are cheap ones."""
    cost: dict[str, float] = {}
    for item in items:
        cost[item.fspath.strpath] = cost.get(item.fspath.strpath, 0.0) + (
            _PROCESS_COST if item.get_closest_marker("slow") else _IN_PROCESS_COST)
    position = {path: rank for rank, path in enumerate(sorted(cost, key=lambda path: -cost[path]))}
    items.sort(key=lambda item: position[item.fspath.strpath])
