"""TensorBoard's HParams dashboard: a run's knobs and pipeline settings, next to its final metrics.

The HParams plugin treats each run holding a session summary as one session (one row of the dashboard) and looks
its metrics up as (session run joined with the metric's group, tag). Pointed at one logdir, TensorBoard names the
logdir's own run "." and its subdirectories "train", "eval_dev": the join gives "./eval_dev", which matches no run,
so metrics kept in subdirectories would never show. Therefore the session, its declared metrics and their values
all live in the logdir itself, the metrics tagged "train/loss" and "eval_<dataset>/<metric>": the dashboard shows
every run's last values whether TensorBoard is pointed at the run or at a folder of runs (each run one row).

TensorBoard takes the hparam and metric columns from the first run it finds: in a folder of runs of different
experiments, knobs the others do not have are not shown for them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp
from tensorboard.plugins.hparams import api_pb2

from gpipe_tf.gpipe.pipeline import find_pipelines
from gpipe_tf.gpipe.schedules import schedule_name
from gpipe_tf.hyperparams import Params

HParamValue = bool | int | float | str


def _value(value: Any) -> HParamValue:
    """An hparam value TensorBoard accepts (bool, int, float, str): others are shown as their repr."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, type):
        return value.__name__
    return repr(value)


class _AnyValue(hp.Domain):
    """A domain that states only the value type. TensorBoard reads one run's declared domains for all runs, so a
    domain holding this run's values (Discrete, an interval) would hide other runs' values from its filters."""

    _TYPES = {float: api_pb2.DATA_TYPE_FLOAT64, str: api_pb2.DATA_TYPE_STRING}

    def __init__(self, dtype: type) -> None:
        self._dtype = dtype

    @property
    def dtype(self) -> type:
        """float or str."""
        return self._dtype

    def sample_uniform(self, rng: Any = None) -> Any:
        """Unbounded domains cannot be sampled."""
        raise TypeError("an unbounded hparam domain cannot be sampled")

    def update_hparam_info(self, hparam_info: api_pb2.HParamInfo) -> None:
        """Sets the type only (numbers: float64, shown with an interval filter)."""
        hparam_info.type = self._TYPES[self._dtype]


def _domain(value: HParamValue) -> hp.Domain:
    if isinstance(value, bool):
        return hp.Discrete([False, True])
    return _AnyValue(str if isinstance(value, str) else float)


def _pipeline(params: Params) -> Params | None:
    found = find_pipelines(params.task)
    return found[0][1] if found else None


def hparams_of(params: Params, knobs: Mapping[str, Any],
               precision: Mapping[str, str] | None = None) -> dict[str, HParamValue]:
    """The hparams of a run: the model key, every experiment knob, and the training and pipeline settings that
    shape a run (learning rate, steps, batch size, optimizer, replicas; K, M, remat, schedule, balance_by), and its
    `precision` (`Learner.precision`: compute dtype and loss scaling) when given.

    The schedule has one column, `pipeline.schedule`, naming the schedule that ran: an experiment's `schedule`
    knob says only what the experiment asked for, and --params may have replaced it."""
    values: dict[str, Any] = {"model": params.model}
    values.update(knobs)
    if precision is not None:
        values.update({f"precision.{name}": value for name, value in precision.items()})
    train = params.train
    values.update({"train.learning_rate": train.learning_rate, "train.max_steps": train.max_steps,
                   "train.optimizer": train.optimizer.cls, "train.num_replicas": train.num_replicas,
                   "input.train.batch_size": params.input.train.batch_size})
    pipe = _pipeline(params)
    if pipe is not None:
        values.pop("schedule", None)
        values.update({"pipeline.num_stages": pipe.num_stages, "pipeline.num_micro_batches": pipe.num_micro_batches,
                       "pipeline.remat": pipe.remat, "pipeline.schedule": schedule_name(pipe.schedule),
                       "pipeline.balance_by": "explicit" if pipe.balance is not None else pipe.balance_by})
    return {name: _value(value) for name, value in values.items()}


def metric_tags(params: Params, task_metrics: Sequence[str]) -> list[str]:
    """The metrics the dashboard shows: the final training loss and every task metric of every eval dataset."""
    return ["train/loss"] + [f"eval_{name}/{metric}" for name in params.eval.datasets for metric in task_metrics]


def write_session(logdir: str, hparams: Mapping[str, HParamValue], metrics: Sequence[str]) -> None:
    """Writes the run's session (its hparams) and the metric columns into `logdir` itself (see the module doc)."""
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
        hp.hparams_config(hparams=[hp.HParam(name, _domain(value)) for name, value in hparams.items()],
                          metrics=[hp.Metric(tag, display_name=tag) for tag in metrics])
        hp.hparams(dict(hparams), trial_id=os.path.basename(os.path.normpath(logdir)))
    writer.close()


def write_metrics(logdir: str, step: int, values: Mapping[str, float]) -> None:
    """Writes metric values for the dashboard into `logdir` itself; its last value of each tag is shown."""
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default(step=step):
        for tag, value in values.items():
            tf.summary.scalar(tag, value)
    writer.close()
