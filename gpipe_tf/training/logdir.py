"""The run directory: created and checked before any work, holding the resolved Params of its model.

A logdir with checkpoints belongs to one model: a second run may change training settings (max_steps, learning
rate, logging) and the pipeline's layout (MATH_NEUTRAL_FIELDS: K, M, balance, schedule, remat, devices), but not
the model key or any other task Params, since its checkpoints would not restore into another model, nor the
training batch size, since the checkpointed input position counts batches of the old size. Task fields added to the
code since a run was written, absent from its params.txt, are no change while they hold their class's defaults.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer

PARAMS_FILE = "params.txt"
CHECKPOINT_DIR = "checkpoints"

# Task fields (matched by their last name, anywhere in the task tree) that change how the pipeline computes, not
# what: checkpoints hold every layer under its global index whatever the stage, and a pipeline without batch norm
# gives the same loss and gradients for any K and M (with batch norm, M changes the micro-batch statistics, as in
# GPipe; with dropout, M changes the masks: `resume_warnings` says so). A new pipeline field that leaves the math
# unchanged belongs here, so that runs may resume with it changed.
MATH_NEUTRAL_FIELDS = frozenset({
    "num_stages", "num_micro_batches", "balance", "balance_by", "micro_batch_shape", "input_dtype", "remat",
    "device_kind", "devices", "schedule", "input_gradients", "parallel_iterations", "jit_compile",
})
# Fields of the resolved tree that the checkpointed input position depends on: changing one on resume is refused.
INPUT_STREAM_FIELDS = ("input.train.batch_size",)


def file_in_the_way(path: str) -> str | None:
    """The file that keeps directory `path` from existing: `path` itself or the nearest of its parents that exists,
    when that one is not a directory (None: `path` is a directory or can be created as one)."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return None if os.path.isdir(current) else current


def check_is_directory(logdir: str, what: str = "--logdir") -> None:
    """ConfigError in one line when `logdir` is a file or lies under one: no run can be kept there. Reads only."""
    blocker = file_in_the_way(logdir)
    if blocker is None:
        return
    shown = f"--logdir={logdir!r}" if what == "--logdir" else f"{logdir!r} ({what})"
    where = "is a file" if blocker == os.path.abspath(logdir) else f"lies under {blocker}, which is a file"
    raise ConfigError(f"{shown} {where}, not a directory; pass the path of a directory (a new path, or the logdir of "
                      f"a run), or move {blocker} away")


def check_writable(logdir: str, what: str = "--logdir") -> None:
    """Creates `logdir` if needed and checks 4 KiB can be written there (a full disk fails); ConfigError otherwise.

    A file where the directory should be is named as such (check_is_directory), not taken for a full disk."""
    check_is_directory(logdir, what)
    try:
        os.makedirs(logdir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=logdir, prefix=".write_test") as f:
            f.write(b"x" * 4096)  # a block: a disk too full for one fails here, not mid-run
            f.flush()
    except OSError as e:
        shown = f"--logdir={logdir!r}" if what == "--logdir" else f"{logdir!r} ({what})"
        raise ConfigError(f"cannot write to {shown}: {e.strerror or e}; free disk space, or pass a directory "
                          "you can write to") from None


def _is_math_neutral(path: str) -> bool:
    """Whether a field path ('task.network.num_stages') is about a MATH_NEUTRAL_FIELDS field."""
    # Any component: a nested pipeline field (task.network.schedule.parallel_iterations) is as neutral as it.
    return any(part.split("[", 1)[0] in MATH_NEUTRAL_FIELDS for part in path.split("."))


def _compare_models(old: Params, new: Params) -> tuple[list[str], list[str]]:
    """(fields of `new` added since `old` was written, at their defaults, as 'path=value'; the other differences in
    model key and task Params, as 'path (here X, there Y)'), the math-neutral fields aside."""
    added: list[str] = []
    different = [] if old.get("model") == new.get("model") else [
        f"model (here {new.get('model')}, there {old.get('model')})"]
    for path, here, there in new.differences(old):
        if path.split(".", 1)[0] != "task" or _is_math_neutral(path):
            continue
        if there is None and new.is_class_default(path):
            added.append(f"{path}={here}")
        else:
            different.append(f"{path} (here {here or 'absent'}, there {there or 'absent'})")
    return added, different


def _draws_randomness(p: Params) -> bool:
    """Whether a layer's Params turn on dropout (rate, *dropout_rate > 0) or drop path (keep_prob < 1)."""
    for name, value in p.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if (name in ("rate", "dropout_rate") or name.endswith("_dropout_rate")) and value > 0:
            return True
        if name == "drop_path_keep_prob" and value < 1:
            return True
    return False


def _micro_batch_sensitive(task: Any) -> list[str]:
    """What of the built `task` depends on how a batch is split into micro-batches: dropout masks (each micro-batch
    draws its own from the step's seed folded with its index) and batch-norm statistics (per micro-batch, as in
    GPipe; a layer with batch statistics overrides `apply_aux_stats`)."""
    layers = [m for m in (task, *task.submodules) if isinstance(m, BaseLayer)]
    dropout = any(_draws_randomness(m.p) for m in layers)
    batch_norm = any(type(m).apply_aux_stats is not BaseLayer.apply_aux_stats for m in layers)
    return (["dropout masks"] if dropout else []) + (["batch-norm statistics"] if batch_norm else [])


def resume_warnings(logdir: str, params: Params, task: Any) -> list[str]:
    """One warning line when a resume changes num_micro_batches (M) of a task (`params.task` built as `task`) whose
    dropout masks or batch-norm statistics depend on it: the rest of the math is unchanged by M, those are not
    (see MATH_NEUTRAL_FIELDS).
    Empty for a new run, an unreadable params.txt (check_compatible reports that) or an M-neutral task."""
    path = os.path.join(logdir, PARAMS_FILE)
    if not _has_checkpoints(logdir) or not os.path.exists(path):
        return []
    try:
        old = read_params(path, params.get("model"))
    except (OSError, ConfigError):
        return []
    if "task" not in old or "task" not in params:
        return []
    changed = [(path, before, now) for path, before, now in old.get("task").differences(params.get("task"))
               if path.rsplit(".", 1)[-1] == "num_micro_batches" and before is not None and now is not None]
    affected = _micro_batch_sensitive(task)
    if not changed or not affected:
        return []
    what = "; ".join(f"task.{path} {before} -> {now}" for path, before, now in changed)
    return [f"warning: resuming with {what}: {' and '.join(affected)} depend on the split into micro-batches, "
            "so the steps from here differ from those of an uninterrupted run with the old value (everything else "
            "is unchanged); resume with the old num_micro_batches to continue it exactly"]


def _changed_input_stream(old: Params, new: Params) -> list[str]:
    lines = []
    for field in INPUT_STREAM_FIELDS:
        before, after = _get_or_none(old, field), _get_or_none(new, field)
        if before != after:
            lines.append(f"{field}: {before} -> {after}")
    return lines


def _get_or_none(params: Params, path: str) -> object:
    try:
        return params.get(path)
    except (ParamsError, AttributeError, KeyError):
        return None


def _has_checkpoints(logdir: str) -> bool:
    directory = os.path.join(logdir, CHECKPOINT_DIR)
    return os.path.isdir(directory) and any(name.startswith("ckpt-") for name in os.listdir(directory))


def read_params(path: str, model: str) -> Params:
    """The Params of a run's params.txt at `path`; ConfigError naming the file and the fix when it is not UTF-8,
    does not parse or names no model (empty or cut short). `model` is this run's key, for the fix's command."""
    fix = (f"if it belongs to this run, write it anew with the run's flags (python trainer.py --model={model} "
           f"--params=... --mode=inspect_params > {path}), else use a new --logdir")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read {path}: it is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}); {fix}") from None
    try:
        old = Params.from_text(text)
    except (ParamsError, ImportError, AttributeError) as e:
        raise ConfigError(f"cannot read {path} ({' '.join(str(e).split())}); {fix}") from None
    if "model" not in old:
        shown = "it is empty" if not text.strip() else "it has no 'model' line (cut short?)"
        raise ConfigError(f"cannot read {path}: {shown}; {fix}")
    return old


def check_compatible(logdir: str, params: Params, training: bool = False) -> list[str]:
    """Refuses a logdir whose checkpoints belong to another model or task shape (or, when `training`, to another
    training batch size). Reads only; a logdir without checkpoints accepts any Params (nothing there to lose).

    Fields added since the logdir's params.txt was written (absent there) that are at their defaults here are no
    difference: the returned note line names them (empty list: nothing to say).
    """
    path = os.path.join(logdir, PARAMS_FILE)
    if not _has_checkpoints(logdir):
        return []
    if not os.path.exists(path):
        raise ConfigError(f"--logdir={logdir!r} holds checkpoints but no {PARAMS_FILE}, so they cannot be "
                          "checked against this model; use a new --logdir")
    old = read_params(path, params.get("model"))
    added, differences = _compare_models(old, params)
    if differences:
        shown = "; ".join(differences[:5]) + (f"; ... {len(differences) - 5} more" if len(differences) > 5 else "")
        raise ConfigError(f"--logdir={logdir!r} holds another model's run: this run's Params differ from its "
                          f"{PARAMS_FILE} in {shown}; use a new --logdir or the same model settings")
    changed = _changed_input_stream(old, params) if training else []
    if changed:
        raise ConfigError(f"--logdir={logdir!r} holds checkpoints whose input position counts batches of the old "
                          f"size ({'; '.join(changed)}); resume with the same batch size, or use a new --logdir")
    if not added:
        return []
    return [f"note: {path} lacks {len(added)} field{'s' if len(added) > 1 else ''} added since that run was "
            f"written; they are taken at their defaults: {', '.join(added)}"]


def write_text(logdir: str, name: str, text: str) -> None:
    """Writes logdir/name atomically (a crash never leaves half a file); a full disk is a one-line ConfigError."""
    path = os.path.join(logdir, name)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}; free disk space, or pass a directory you can "
                          "write to") from None


def write_params(logdir: str, params: Params) -> None:
    """Writes the resolved Params to logdir/params.txt atomically."""
    write_text(logdir, PARAMS_FILE, params.to_text())


def prepare(logdir: str, params: Params) -> None:
    """Checks the logdir can be written and belongs to this model, then records the Params."""
    check_writable(logdir)
    check_compatible(logdir, params, training=True)
    write_params(logdir, params)
