"""The schedules a GPipe layer can run, by name, and the Params a `schedule` field stands for."""

from __future__ import annotations

import re
from typing import Any

from gpipe_tf.gpipe import batched_weights
from gpipe_tf.gpipe.fill_drain import FillDrain
from gpipe_tf.gpipe.interleaved import Interleaved
from gpipe_tf.gpipe.one_f_one_b import OneForwardOneBackward
from gpipe_tf.gpipe.orders import ScheduleOrder
from gpipe_tf.gpipe.schedule_base import Schedule
from gpipe_tf.gpipe.spmd import SpmdPipeline
from gpipe_tf.gpipe.unrolled import Unrolled
from gpipe_tf.gpipe.windowed_loop import WindowedSchedule
from gpipe_tf.gpipe.zero_bubble import ZeroBubble
from gpipe_tf.gpipe.zero_bubble_v import ZeroBubbleV
from gpipe_tf.hyperparams import InstantiableParams, ParamsError

__all__ = ["FillDrain", "Interleaved", "OneForwardOneBackward", "SpmdPipeline", "Unrolled", "ZeroBubble", "ZeroBubbleV",
           "SCHEDULES", "schedule_params", "schedule_name", "step_order", "schedule_help"]

# Short names a `schedule` field may hold instead of Params (e.g. on the command line): each stands for its
# class's default Params. Each class gives its own (`Schedule.short_names`); importing them all here fills the table.
SCHEDULES: dict[str, type[Schedule]] = Schedule.short_names()


def schedule_params(value: Any, path: str = "") -> InstantiableParams:
    """The schedule Params a GPipe `schedule` field stands for: Params of a `Schedule` class, or a short name."""
    if isinstance(value, str) and value in SCHEDULES:
        return SCHEDULES[value].params()
    if isinstance(value, InstantiableParams) and isinstance(value.cls, type) and issubclass(value.cls, Schedule):
        return value
    raise ParamsError(f"{path}.schedule={value!r} is not a schedule: use Params of a Schedule class, e.g. "
                      "FillDrain.params(), OneForwardOneBackward.params(), Interleaved.params().set(virtual_stages=2) "
                      f"or Unrolled.params(), or one of the names {tuple(SCHEDULES)}")


def schedule_name(value: Any, path: str = "") -> str:
    """The one name a run's schedule is shown by (console, HParams): its class, with v for Interleaved and
    `batch_weight_gradients` when not the default "auto", e.g. 'FillDrain', 'Interleaved(virtual_stages=3)' or
    'ZeroBubble(batch_weight_gradients=True)'."""
    p = schedule_params(value, path)
    knobs = [f"virtual_stages={p.virtual_stages}"] if issubclass(p.cls, Interleaved) else []
    if issubclass(p.cls, (WindowedSchedule, FillDrain)) and p.batch_weight_gradients != batched_weights.AUTO:
        knobs.append(f"batch_weight_gradients={p.batch_weight_gradients!r}")
    return f"{p.cls.__name__}({', '.join(knobs)})" if knobs else p.cls.__name__


def step_order(value: Any, num_stages: int, path: str = "") -> ScheduleOrder:
    """The order data of the schedule a `schedule` field stands for (Params or a short name), on `num_stages`
    devices (`Schedule.step_order`)."""
    return schedule_params(value, path).instantiate(path).step_order(max(1, int(num_stages)))


def schedule_help() -> str:
    """The help of a GPipe `schedule` field, from the table: every short name with its class and the first sentence
    of the class's docstring, so that a new schedule shows up in it without an edit here."""
    names = []
    for name, cls in SCHEDULES.items():
        doc = " ".join((cls.__doc__ or "").split())
        summary = re.match(r"(.+?)\.(?=\s+[A-Z]|$)", doc)
        names.append(f"'{name}' ({cls.__name__}: {summary.group(1) if summary else doc})")
    return ("The schedule: Params of a Schedule class, e.g. Interleaved.params().set(virtual_stages=3), or a short "
            f"name, which stands for its class's default Params: {'; '.join(names)}. "
            "docs/pipeline.md#choosing-a-schedule says which to pick.")
