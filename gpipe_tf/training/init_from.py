"""`train.init_from`: start a new run from another run's checkpoint (fine-tuning), Lingvo's init_from_checkpoint_rules.

Rules map this model's variable names (`classifier/network/fc0/w`, the names `tf.Variable.name` shows without
`:0`) to variable names in the source checkpoint: `(regex, replacement)` pairs, tried in order; the first regex
that matches the whole name wins and the source name is `re.Match.expand(replacement)` (`\\1`, `\\g<name>`). The
default rule copies every variable from the source variable of the same name. `ignore` regexes keep chosen
variables at their initial values (e.g. a new softmax head).

Applied once, at step 0 of a new run: a run that resumes from its own checkpoints never reads the source again.
Only the model's variables are copied (batch-norm moving averages included); the optimizer's slots, the global
step and the input position start fresh. Every variable not copied is listed: matched by no rule, ignored, absent
from the source, or of another shape there (a new head with another number of classes).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.training import checkpoints
from gpipe_tf.training.checkpoints import source_variables, variable_name

# Object-graph keys of the task's own variables in a trainer checkpoint (not optimizer slots: they carry the
# variable's name too, plus a slot suffix).
# Names listed per category in the log line, at most.
_SHOWN = 8


def init_from_params() -> Params:
    """Params of the `train.init_from` subtree."""
    p = Params()
    p.define("checkpoint", "", "Start a NEW run from this checkpoint (a ckpt-N prefix, or a run's logdir: its newest "
             "checkpoint); '' starts from the initializers. Never applied when the run resumes from its own "
             "checkpoints.")
    p.define("rules", [(".*", "\\g<0>")], "(regex, replacement) pairs: the first regex matching the whole variable "
             "name maps it to the source name match.expand(replacement); default: the same name.")
    p.define("ignore", [], "Regexes of variable names (whole match) to keep at their initial values, e.g. "
             "['classifier/softmax/.*'] for a new head.")
    return p


def check(p: Params) -> None:
    """ParamsError naming the first malformed rule or regex of `train.init_from`."""
    if not isinstance(p.checkpoint, str):
        raise ParamsError(f"train.init_from.checkpoint={p.checkpoint!r} must be a path string ('' for none)")
    for i, rule in enumerate(p.rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise ParamsError(f"train.init_from.rules[{i}]={rule!r} must be a (regex, replacement) pair of strings, "
                              "e.g. ('classifier/network/(.*)', 'classifier/network/\\\\1')")
        _compile(rule[0], f"train.init_from.rules[{i}]")
    for i, pattern in enumerate(p.ignore):
        if not isinstance(pattern, str):
            raise ParamsError(f"train.init_from.ignore[{i}]={pattern!r} must be a regex string")
        _compile(pattern, f"train.init_from.ignore[{i}]")


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ParamsError(f"{where}: {pattern!r} is not a regular expression ({e}); fix the pattern") from None


@dataclasses.dataclass
class InitPlan:
    """What `plan` decided for each variable (names are this model's unless said otherwise)."""

    copies: list[tuple[tf.Variable, str, str]] = dataclasses.field(default_factory=list)  # (variable, source, key)
    no_rule: list[str] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)
    not_in_source: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, source name)
    shape_mismatch: list[tuple[str, list[int], list[int]]] = dataclasses.field(
        default_factory=list)  # (name, shape, source shape)


def plan(variables: Sequence[tf.Variable], source: dict[str, tuple[str, list[int]]], p: Params) -> InitPlan:
    """Decides, for each of `variables`, the source variable it is copied from, or why it is not copied."""
    check(p)
    rules = [(_compile(regex, ""), replacement) for regex, replacement in p.rules]
    ignore = [_compile(pattern, "") for pattern in p.ignore]
    result = InitPlan()
    for variable in variables:
        name = variable_name(variable)
        if any(pattern.fullmatch(name) for pattern in ignore):
            result.ignored.append(name)
            continue
        found = next(((m, r) for m, r in ((regex.fullmatch(name), r) for regex, r in rules) if m), None)
        if found is None:
            result.no_rule.append(name)
            continue
        source_name = found[0].expand(found[1])
        if source_name not in source:
            result.not_in_source.append((name, source_name))
            continue
        key, source_shape = source[source_name]
        shape = variable.shape.as_list()
        if shape != source_shape:
            result.shape_mismatch.append((name, shape, source_shape))
            continue
        result.copies.append((variable, source_name, key))
    return result


def _listed(items: list[str]) -> str:
    return checkpoints.listed(items, _SHOWN)


def describe(result: InitPlan, path: str, total: int) -> list[str]:
    """Log lines: how many variables were copied from `path`, then each category of variables left as initialized."""
    lines = [f"initialized {len(result.copies)} of {total} variables from {path} (train.init_from)"]
    if result.no_rule:
        lines.append(f"init_from: matched by no rule, left as initialized: {_listed(result.no_rule)}")
    if result.ignored:
        lines.append(f"init_from: ignored (train.init_from.ignore), left as initialized: {_listed(result.ignored)}")
    if result.not_in_source:
        lines.append("init_from: not in the source checkpoint, left as initialized: "
                     + _listed([f"{n} (looked for {s})" for n, s in result.not_in_source]))
    if result.shape_mismatch:
        lines.append("init_from: another shape in the source checkpoint, left as initialized: "
                     + _listed([f"{n} {shape} (source {src})" for n, shape, src in result.shape_mismatch]))
    return lines


def prepare(variables: Sequence[tf.Variable], p: Params) -> tuple[str, InitPlan]:
    """The source checkpoint's path and the plan for `variables`; reads no value and changes nothing.

    ConfigError naming the path when `p.checkpoint` names no readable checkpoint, and naming the rules and some
    of the source's variable names when they copy no variable at all (a run would silently train from scratch).
    """
    path = checkpoints.resolve(p.checkpoint, "train.init_from.checkpoint")
    reason = checkpoints.unreadable_reason(path)
    if reason is not None:
        raise ConfigError(f"train.init_from.checkpoint: checkpoint {path} cannot be read ({reason}); name another "
                          "checkpoint")
    source = source_variables(path)
    result = plan(variables, source, p)
    if not result.copies:
        why = "; ".join(line.split(": ", 1)[1] for line in describe(result, path, len(variables))[1:])
        raise ConfigError(f"train.init_from copies none of this model's {len(variables)} variables from {path} "
                          f"(rules={list(p.rules)!r}, ignore={list(p.ignore)!r}; {why}); the source holds "
                          f"{_listed(sorted(source))}: fix train.init_from.rules so that they map this model's "
                          "names to those (default: the same names)")
    return path, result


def apply(variables: Sequence[tf.Variable], p: Params, log: Callable[[str], None],
          prepared: tuple[str, InitPlan] | None = None) -> InitPlan:
    """Copies the source checkpoint's values into `variables` by `p`'s rules; logs what was and was not copied.

    prepared: what `prepare` returned for the same variables and Params, so that the source is checked and read
    once; None prepares here, with ConfigError as `prepare` when the source cannot be read or the rules copy
    nothing.
    """
    path, result = prepared if prepared is not None else prepare(variables, p)
    reader = tf.train.load_checkpoint(path)
    for variable, _, key in result.copies:
        variable.assign(tf.cast(reader.get_tensor(key), variable.dtype))
    for line in describe(result, path, len(variables)):
        log(line)
    return result
