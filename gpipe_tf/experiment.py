"""Experiments: knobs in, one resolved Params tree out (task, inputs, training, evaluation).

An experiment is a class in `params/<area>/<module>.py`, registered with `model_registry.register`. Its knobs are
plain lower-case class attributes; gin bindings (`BlobsMlp.hidden_dim = 128`) and constructor keywords override
them. Its methods return Params, as in Lingvo: `task()`, `train_input()`, `dev_input()`, `test_input()` and
`training()`. `model_params()` assembles them into the tree the trainer runs; dotted `--params` overrides apply
last. Precedence: experiment defaults < gin < --params.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import tokenize
from collections.abc import Sequence
from typing import Any

import gin

from gpipe_tf import model_registry
from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.batch_shapes import batch_rows, rescaled_micro_batch_shape
from gpipe_tf.hyperparams import InstantiableParams, Params, parse_overrides
from gpipe_tf.training import run_seed

DATASETS = ("train", "dev", "test")


class Experiment:
    """Base class of experiments. Subclasses set knobs as class attributes and override the Params methods."""

    # Knob: split the CPU into this many logical devices at start-up (pipelines on a machine without GPUs).
    logical_devices: int | None = None

    def __init__(self, **knobs: Any) -> None:
        allowed = self.knobs()
        for name, value in knobs.items():
            if name not in allowed:
                close = difflib.get_close_matches(name, list(allowed), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{type(self).__name__} has no knob {name!r}{hint} "
                                  f"(knobs: {', '.join(sorted(allowed))})")
            _check_knob_type(type(self).__name__, name, allowed[name], value)
            setattr(self, name, value)

    @classmethod
    def knobs(cls) -> dict[str, Any]:
        """The experiment's knobs: public, non-callable class attributes, with their defaults."""
        out: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if not name.startswith("_") and name.islower() and not callable(value) and not isinstance(
                        value, (classmethod, staticmethod, property)):
                    out[name] = value
        out.pop("registry_key", None)
        return out

    def task(self) -> InstantiableParams:
        """Params of the task (layers, loss, metrics)."""
        raise NotImplementedError(f"{type(self).__name__}.task")

    def train_input(self) -> InstantiableParams:
        """Params of the training input."""
        raise NotImplementedError(f"{type(self).__name__}.train_input")

    def dev_input(self) -> InstantiableParams | None:
        """Params of the development (validation) input; None if there is none."""
        return None

    def test_input(self) -> InstantiableParams | None:
        """Params of the test input; None if there is none."""
        return None

    def training(self) -> Params:
        """Params of the `train` subtree (optimizer, schedule, intervals); see learner.training_params."""
        # Deferred: it imports TensorFlow, which --list_models (importing every experiment module) must not load.
        from gpipe_tf.training.learner import training_params  # noqa: PLC0415
        return training_params()

    def eval_params(self) -> Params:
        """Params of the `eval` subtree."""
        p = Params()
        p.define("datasets", [n for n in DATASETS[1:] if getattr(self, f"{n}_input")() is not None],
                 "Datasets evaluated by --mode=eval, each into logdir/eval_<name>.")
        p.define("beam_size", 4, "--mode=decode: beam size (1: greedy search).")
        p.define("length_penalty_alpha", 0.6, "--mode=decode: GNMT length penalty exponent.")
        p.define("decode_max_length", 0, "--mode=decode: longest output in tokens; 0: the input's max_length.")
        return p

    def model_params(self) -> Params:
        """The whole resolved tree: model key, task, train, input.{train,dev,test}, eval."""
        root = Params()
        root.define("model", getattr(type(self), "registry_key", type(self).__name__), "Registry key.")
        root.define("task", self.task(), "The task: layers, loss and metrics.")
        root.define("train", self.training(), "Optimization and training-loop settings.")
        inputs = Params()
        for name in DATASETS:
            inputs.define(name, getattr(self, f"{name}_input")(), f"Input Params of the {name} dataset.")
        root.define("input", inputs, "Input generators, one per dataset.")
        root.define("eval", self.eval_params(), "Evaluation settings.")
        root.define("logical_devices", self.logical_devices,
                    "Split the CPU into this many logical devices at start-up; None: leave it whole.")
        return root


def _check_knob_type(experiment: str, name: str, default: Any, value: Any) -> None:
    """ConfigError when `value` is not of the kind of the knob's default (a gin binding of the wrong type).

    Ints may stand for floats, lists for tuples; a knob whose default is None takes anything.
    """
    if default is None or value is None:
        return
    kinds: tuple[type, ...]
    if isinstance(default, bool):
        kinds = (bool,)
    elif isinstance(default, float):
        kinds = (int, float)
    elif isinstance(default, int):
        kinds = (int,)
    elif isinstance(default, (tuple, list)):
        kinds = (tuple, list)
    else:
        kinds = (type(default),)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"{experiment}.{name}={value!r} is a {type(value).__name__}, but the knob takes a "
                          f"{' or '.join(k.__name__ for k in kinds)} (default {default!r}); e.g. "
                          f"--gin_param=\"{experiment}.{name}={default!r}\"")


_GIN_REGISTERED: set[str] = set()


def _knob_binder(cls: type) -> Any:
    """Registers (once) a gin configurable named after the experiment that collects its bound knobs."""
    key = cls.registry_key
    module, name = key.rsplit(".", 1)
    if key not in _GIN_REGISTERED:
        def bind(**knobs: Any) -> dict[str, Any]:
            return knobs
        # gin's operative config lists the parameters of each called configurable from its signature: with a bare
        # **knobs it held only explicit bindings (an empty file for a run without any). Naming every knob with its
        # default makes operative_config.gin the run's complete knob values, reusable as --gin_file.
        # The trailing **knobs lets gin accept any name, so that a typo reaches the experiment's own check, which
        # suggests the closest knob.
        bind.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
            *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
              for name, default in sorted(cls.knobs().items())),
            inspect.Parameter("knobs", inspect.Parameter.VAR_KEYWORD)])
        # Parsing locks gin's registry; an experiment resolved later in the same process still registers.
        with gin.unlock_config():
            gin.external_configurable(bind, name=name, module=module)
        _GIN_REGISTERED.add(key)
    return gin.get_configurable(f"{module}.{name}")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A resolved experiment: its frozen Params, gin's operative config text, the knob values it used, and one
    line per override that replaced a class and so reset fields set before it (for the console)."""

    params: Params
    operative_config: str
    knobs: dict[str, Any]
    notes: tuple[str, ...] = ()


def resolve(model: str, gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (),
            overrides: str = "") -> Resolved:
    """Builds the frozen Params tree of registered `model` with gin and dotted overrides applied.

    Also returns the operative gin config (every knob with the value used), the knob values themselves and the
    notes of overrides that replaced a class (`Params.override`). Errors are ConfigError/ParamsError with one-line
    messages.
    """
    cls = model_registry.get(model)
    for path in gin_files:
        # Checked here: gin's own lookup of a missing file logs an error line and can raise a TypeError.
        if not os.path.isfile(path):
            where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
            raise ConfigError(f"--gin_file={path!r}: no such file{where}; check the path")
    binder = _knob_binder(cls)
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings))
    except (ValueError, OSError, SyntaxError, KeyError, tokenize.TokenError) as e:
        raise ConfigError(f"bad gin config: {' '.join(str(e).split())}") from e
    experiment = cls(**binder())
    params = experiment.model_params()
    pairs = parse_overrides(overrides)
    notes: list[str] = []
    before = dict(_pipeline_batches(params))
    for key, text in pairs:
        params.override(key, text, notes)
    _follow_micro_batch_counts(params, before, {key for key, _ in pairs}, notes)
    run_seed.apply(params, [key for key, _ in pairs])
    knobs = {name: getattr(experiment, name) for name in sorted(cls.knobs())}
    return Resolved(params=params.freeze(), operative_config=gin.operative_config_str(), knobs=knobs,
                    notes=tuple(f"note: --params {note}" for note in notes))


def _pipeline_batches(p: Params, path: str = "") -> list[tuple[str, tuple[int, Any]]]:
    """(dotted path, (num_micro_batches, micro_batch_shape)) of every pipeline's Params in `p` (a node with both
    fields: a GPipe's), outside lists. Told apart by their fields, not by `gpipe.pipeline.find_pipelines`' class
    test: that module imports TensorFlow, which resolving an experiment must not."""
    found = []
    if "num_micro_batches" in p and "micro_batch_shape" in p:
        found.append((path, (p.num_micro_batches, p.micro_batch_shape)))
    for name, value in p.items():
        if isinstance(value, Params):
            found += _pipeline_batches(value, f"{path}.{name}" if path else name)
    return found


def _follow_micro_batch_counts(params: Params, before: dict[str, tuple[int, Any]], keys: set[str],
                               notes: list[str]) -> None:
    """An override of a pipeline's num_micro_batches that leaves the experiment's micro_batch_shape as it was
    rescales that shape, so that micro-batches x M is still the experiment's batch (the memory planner sizes the
    activations by it); the change is noted."""
    for path, (m, shape) in _pipeline_batches(params):
        m_before, shape_before = before.get(path, (m, shape))
        if m == m_before or shape is None or shape != shape_before or f"{path}.micro_batch_shape" in keys:
            continue
        new = rescaled_micro_batch_shape(shape, m_before, m)
        if new is None:
            raise ConfigError(f"--params {path}.num_micro_batches={m}: the experiment's batch of "
                              f"{batch_rows(shape, m_before)} rows ({path}.micro_batch_shape="
                              f"{shape} at {m_before} micro-batches) does not split into {m}; use a divisor of it, "
                              f"or set {path}.micro_batch_shape too")
        params.override(f"{path}.micro_batch_shape", repr(new))
        notes.append(f"{path}.num_micro_batches={m} rescaled {path}.micro_batch_shape from {shape} to {new} (the "
                     "same batch)")


def resolve_params(model: str, gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (),
                   overrides: str = "") -> tuple[Params, str]:
    """`resolve(...)` as (params, operative gin config text)."""
    resolved = resolve(model, gin_files, gin_bindings, overrides)
    return resolved.params, resolved.operative_config
