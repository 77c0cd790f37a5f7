"""Several fresh processes' per-device figures of one configuration combined into one figure per device."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def combine(runs: Sequence[Sequence[float]], reduce: Callable[[Sequence[float]], float],
            what: str) -> list[float]:
    """Per device, `reduce` of its figures over `runs` (`runs[r][device]`); `what` names them in the error for no
    runs or runs of different numbers of devices."""
    if not runs or len({len(r) for r in runs}) != 1:
        raise ValueError(f"{what}: runs {list(runs)!r} must be one or more lists of the same number of devices")
    return [reduce(device) for device in zip(*runs)]
