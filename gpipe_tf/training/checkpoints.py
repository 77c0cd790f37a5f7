"""Checkpoints of a training run: task variables, optimizer slots, global step and input position.

The files on disk are the truth, not TensorFlow's `checkpoint` state file: checkpoints are found by listing
`ckpt-N.index` files, so a damaged, emptied or deleted state file never hides (and so never lets a run overwrite)
the checkpoints it should have named. A checkpoint is used only after every tensor of it was read back; a damaged
one is named in a warning and the next older one is tried.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tensorflow.python.training import checkpoint_state_pb2  # the state file's proto; TensorFlow exports no alias

from gpipe_tf.errors import ConfigError
from gpipe_tf.training.logdir import CHECKPOINT_DIR, PARAMS_FILE

STATE_FILE = "checkpoint"
_FILE_RE = re.compile(r"^ckpt-(\d+)\.(index|data-\d+-of-\d+)$")
# A truncated or corrupt file surfaces as one of these from the kernels, or IndexError from the Python reader.
_CORRUPT = (tf.errors.OpError, IndexError)
# restore_latest lists the checkpoints again at most this many times when one vanishes while it is read.
_MAX_LISTINGS = 100


def checkpoint_dir(logdir: str) -> str:
    """Where the trainer's checkpoints live."""
    return os.path.join(logdir, CHECKPOINT_DIR)


def make_manager(checkpoint: tf.train.Checkpoint, logdir: str, max_to_keep: int) -> tf.train.CheckpointManager:
    """A CheckpointManager over logdir/checkpoints."""
    return tf.train.CheckpointManager(checkpoint, checkpoint_dir(logdir), max_to_keep=max_to_keep)


def step_of(path: str) -> int:
    """The global step in a checkpoint path `.../ckpt-N`."""
    return int(path.rsplit("-", 1)[1])


def _steps_on_disk(logdir: str) -> tuple[list[int], list[int]]:
    """(steps with an index file, steps with data files but no index), each sorted."""
    directory = checkpoint_dir(logdir)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    indexed, with_data = set(), set()
    for name in names:
        match = _FILE_RE.match(name)
        if match:
            (indexed if match.group(2) == "index" else with_data).add(int(match.group(1)))
    return sorted(indexed), sorted(with_data - indexed)


def checkpoint_paths(logdir: str) -> list[str]:
    """Every checkpoint on disk (an `.index` file), oldest first, whatever the state file says."""
    return [os.path.join(checkpoint_dir(logdir), f"ckpt-{step}") for step in _steps_on_disk(logdir)[0]]


def state_file_problem(logdir: str) -> str | None:
    """Why the state file does not describe the checkpoints on disk (None: it does, or there are none).

    The file is parsed here, not by `tf.train.get_checkpoint_state`, which logs two lines of its own for a damaged
    one ("ParseError: ...", "Checkpoint ignored") beside the one warning the caller prints.
    """
    paths = checkpoint_paths(logdir)
    if not paths:
        return None
    path = os.path.join(checkpoint_dir(logdir), STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"{path} is unreadable ({_short(e)})"
    state = checkpoint_state_pb2.CheckpointState()
    try:
        text_format.Merge(text, state)  # as TensorFlow reads it
    except text_format.ParseError:
        return f"{path} cannot be parsed (empty, cut or garbage)"
    if not state.model_checkpoint_path:
        return f"{path} names no checkpoint (empty, cut or garbage)"
    named = os.path.basename(state.model_checkpoint_path)
    if named != os.path.basename(paths[-1]):
        return f"{path} names {named!r} but {os.path.basename(paths[-1])} is the newest on disk"
    return None


def unreadable_reason(path: str) -> str | None:
    """Why checkpoint `path` cannot be read back completely (None: its index and every tensor read fine)."""
    try:
        reader = tf.train.load_checkpoint(path)
        for name, dtype in reader.get_variable_to_dtype_map().items():
            if dtype != tf.variant:  # the input iterator's state: no NumPy form; restore() reads it
                reader.get_tensor(name)
    except _CORRUPT as e:
        return _short(e)
    return None


def restore_latest(checkpoint: tf.train.Checkpoint, logdir: str, partial: bool = False,
                   warn: Callable[[str], None] = print, read_elsewhere: Collection[str] = ()) -> str | None:
    """Restores the newest checkpoint that restores completely; returns its path (None: there is none).

    Checkpoints are found by listing the files (a damaged state file is named in a warning). A damaged newest
    checkpoint (a crash or a full disk while it was written, a deleted file) is named in a warning and the previous
    one is tried. `partial` allows objects of the checkpoint to be left unread (an evaluator reads the model only);
    `read_elsewhere` names those the caller reads itself (`restore`).
    Raises ConfigError when checkpoints exist but none restores, and for a checkpoint of another model.
    """
    problem = state_file_problem(logdir)
    if problem:
        warn(f"warning: {problem}; using the checkpoint files found in {checkpoint_dir(logdir)}")
    for step in _steps_on_disk(logdir)[1]:
        warn(f"warning: ckpt-{step} in {checkpoint_dir(logdir)} has data files but no index file; skipped")
    paths = checkpoint_paths(logdir)
    failed: set[str] = set()
    # A trainer beside an evaluator saves and rotates while it reads: a checkpoint whose index file is gone by the
    # time its read fails was deleted (max_checkpoints_to_keep), not damaged; the files are listed again and the
    # newest is tried, without a warning. Each listing has one checkpoint more gone, so this ends.
    for _ in range(_MAX_LISTINGS):
        vanished = False
        for path in reversed(paths):
            if path in failed:
                continue
            reason = unreadable_reason(path)
            if reason is None:
                try:
                    restore(checkpoint, path, partial, read_elsewhere)
                    return path
                except _CORRUPT as e:
                    reason = _short(e)
            if not os.path.exists(path + ".index"):
                vanished = True
                break
            failed.add(path)
            warn(f"warning: checkpoint {path} is unreadable ({reason}); trying the previous one")
        if not vanished:
            break
        paths = checkpoint_paths(logdir)
    if paths:
        raise ConfigError(f"none of the {len(paths)} checkpoints in {checkpoint_dir(logdir)} can be read back "
                          "(warnings above); nothing was written: restore the files from a backup or use a new "
                          "--logdir")
    return None


def repair_state_file(logdir: str, restored: str) -> None:
    """Rewrites the state file to list the checkpoints on disk up to `restored` (the one training goes on from).

    Called after a fallback or a damaged state file, so that CheckpointManager sees the real checkpoints (and
    max_checkpoints_to_keep counts them) and the next run does not warn again about the same state file.
    """
    step = step_of(restored)
    kept = [p for p in checkpoint_paths(logdir) if step_of(p) <= step]
    # The manager keeps (and later deletes, past max_to_keep) only checkpoints newer than last_preserved_timestamp.
    times = [os.path.getmtime(p + ".index") for p in kept]
    lines = [f'model_checkpoint_path: "{os.path.basename(restored)}"']
    lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in kept]
    lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in times]
    lines.append(f"last_preserved_timestamp: {min(times) - 1.0!r}")
    path = os.path.join(checkpoint_dir(logdir), STATE_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:  # the text form of TF's CheckpointState proto
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


# Where a checkpoint whose weights cannot take a finite step is moved (never deleted): see `quarantine`.
QUARANTINE_DIR = "nonfinite"
# Leftovers of a save that a crash interrupted: TensorFlow's sharded-save directory and the state file's temporary.
_LEFTOVER_RE = re.compile(r"^(ckpt-\d+_temp|checkpoint\.tmp.*)$")


def quarantine(logdir: str, paths: Sequence[str]) -> str | None:
    """Moves the files of the checkpoints `paths` into checkpoints/nonfinite/ (replacing older copies there) and
    makes the newest checkpoint left the latest; returns its path (None: no checkpoint is left, a rerun starts
    afresh)."""
    directory = checkpoint_dir(logdir)
    target = os.path.join(directory, QUARANTINE_DIR)
    os.makedirs(target, exist_ok=True)
    prefixes = tuple(os.path.basename(path) + "." for path in paths)
    for name in sorted(os.listdir(directory)):
        if name.startswith(prefixes) and _FILE_RE.match(name):
            os.replace(os.path.join(directory, name), os.path.join(target, name))
    left = checkpoint_paths(logdir)
    if left:
        repair_state_file(logdir, left[-1])
        return left[-1]
    state = os.path.join(directory, STATE_FILE)
    if os.path.exists(state):
        os.remove(state)
    return None


def remove_leftovers(logdir: str) -> list[str]:
    """Deletes what crashed saves left in checkpoints/ (`ckpt-N_temp/`, `checkpoint.tmp*`); returns their names.

    Only for the trainer that holds the logdir's lock: no other process is saving then.
    """
    directory = checkpoint_dir(logdir)
    try:
        names = sorted(n for n in os.listdir(directory) if _LEFTOVER_RE.match(n))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        full = os.path.join(directory, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.remove(full)
    return names


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


# TensorFlow's I/O errors read "{{function_node __wrapped__SaveV2_...}} <file>.tempstate<N>; <cause> [Op:SaveV2]".
_FUNCTION_NODE_RE = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_OP_SUFFIX_RE = re.compile(r"\s*\[Op:\w+\]\s*$")
_TEMP_STATE_RE = re.compile(r"\.tempstate\d+")


def write_failure(error: OSError | tf.errors.OpError, directory: str) -> str:
    """Why a save into `directory` failed, in one line and whole: TensorFlow's function-name prefix and op suffix
    dropped, files named relative to `directory` without TensorFlow's `.tempstateN` suffix, e.g.
    `ckpt-30_temp/part-00000-of-00001.data-00000-of-00001; File too large`. Never cut: the cause is at the end."""
    if isinstance(error, OSError) and error.strerror:
        message = f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    else:
        message = error.message if isinstance(error, tf.errors.OpError) else str(error)
        message = _OP_SUFFIX_RE.sub("", _FUNCTION_NODE_RE.sub("", message))
    message = _TEMP_STATE_RE.sub("", message).replace(os.path.join(directory, ""), "")
    return " ".join(message.split())


_TASK_PREFIX = "task/"
_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# The optimizer's state in a trainer checkpoint (optimizer_base.Optimizer): its step counter and its slots, keyed
# `optimizer/slots/<slot key>/<slot name>/.ATTRIBUTES/VARIABLE_VALUE`.
_SLOTS_PREFIX = "optimizer/slots/"
_ITERATIONS_KEY = "optimizer/iterations/.ATTRIBUTES/VARIABLE_VALUE"
_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


class SavedLayout(NamedTuple):
    """What a checkpoint holds, read once from its index: the names of its top-level objects (task, optimizer,
    ema, ...), {checkpoint key: the saved variable's name} and {checkpoint key: shape}."""

    top_level: frozenset[str]
    names: dict[str, str]
    shapes: dict[str, list[int]]


def saved_layout(path: str) -> SavedLayout:
    """The `SavedLayout` of checkpoint `path`."""
    reader = tf.train.load_checkpoint(path)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH_KEY))
    return SavedLayout(
        top_level=frozenset(child.local_name for child in graph.nodes[0].children),
        names={attribute.checkpoint_key: attribute.full_name for node in graph.nodes for attribute in node.attributes},
        shapes={key: list(shape) for key, shape in reader.get_variable_to_shape_map().items()})


def _run_params(path: str) -> str:
    """The params.txt of the run whose checkpoint `path` (LOGDIR/checkpoints/ckpt-N) is."""
    return os.path.join(os.path.dirname(os.path.dirname(path)), PARAMS_FILE)


def source_variables(path: str, layout: SavedLayout | None = None) -> dict[str, tuple[str, list[int]]]:
    """The task variables of a trainer checkpoint: {variable name: (checkpoint key, shape)} (`layout`: its
    `saved_layout`, when read already)."""
    _, names, shapes = layout or saved_layout(path)
    return {name: (key, shapes[key]) for key, name in names.items()
            if key.startswith(_TASK_PREFIX) and key in shapes and name}


def optimizer_mismatch(checkpoint: tf.train.Checkpoint, path: str, layout: SavedLayout | None = None) -> str | None:
    """How the optimizer slots of checkpoint `path` differ from those of `checkpoint.optimizer`, naming both
    optimizers and the way on (None: the same slots, or `checkpoint` restores no optimizer).

    Slots are compared by variable, name and shape: an optimizer whose slots another one saved (Adam's `m` and
    `v`, Adafactor's `vr`, `vc`) cannot continue from them, and TensorFlow's matching would restore the slots that
    happen to share a name (Adafactor's unfactored `v` from Adam's) and leave the others at their initial values.
    """
    optimizer = getattr(checkpoint, "optimizer", None)
    own_slots = getattr(optimizer, "slots", None)
    if own_slots is None:
        return None
    _, names, shapes = layout or saved_layout(path)
    saved = {key[len(_SLOTS_PREFIX):-len(_VALUE_SUFFIX)]: shape for key, shape in shapes.items()
             if key.startswith(_SLOTS_PREFIX) and key.endswith(_VALUE_SUFFIX)}
    # Checkpoint keys escape a '.' of an object's name as '..' (slot keys hold no '/').
    own = {f"{key.replace('.', '..')}/{name}": slot.shape.as_list() for key, slots in own_slots.items()
           for name, slot in slots.items()}
    if saved == own:
        return None
    saved_name = names.get(_ITERATIONS_KEY, "").rsplit("/", 1)[0] or "of unknown name"
    own_name = optimizer.p.name
    run_params = _run_params(path)
    if saved_name == own_name:
        return (f"checkpoint {path} holds slots of optimizer {own_name} of other names or shapes than this run's: "
                f"train.optimizer's settings differ from those in {run_params} (e.g. a factoring threshold); resume "
                "with that run's settings, or start a new run from these weights: a new --logdir and "
                f"--params=train.init_from.checkpoint={path} (a fine-tune: docs/fine_tuning.md#another-optimizer)")

    def slot_names(layout: dict[str, list[int]]) -> str:
        return ", ".join(sorted({key.rsplit("/", 1)[1] for key in layout})) or "none"

    return (f"checkpoint {path} holds the slots of optimizer {saved_name} ({slot_names(saved)}), this run's optimizer "
            f"{own_name} keeps others ({slot_names(own)}): the optimizer's slots differ from the checkpoint's, so its "
            f"state cannot continue here; resume with the run's own optimizer ({saved_name}: train.optimizer as in "
            f"{run_params}), or start a new run from these weights with {own_name}: a new --logdir and "
            f"--params=train.init_from.checkpoint={path} (a fine-tune: docs/fine_tuning.md#another-optimizer)")


def variable_name(variable: tf.Variable) -> str:
    """A variable's name without the `:0` suffix, the name rules match."""
    return variable.name.rsplit(":", 1)[0]


def model_mismatch(checkpoint: tf.train.Checkpoint, path: str, layout: SavedLayout | None = None) -> str | None:
    """How the model variables of checkpoint `path` differ from those of `checkpoint.task` (None: the same names
    and shapes, or `checkpoint` has no task).

    TensorFlow's own matching only checks that each of the model's variables is in the file: a model that is a
    part of another (2 hidden layers of a 3-layer run) would silently restore from it.
    """
    task = getattr(checkpoint, "task", None)
    if task is None:
        return None
    saved = {name: shape for name, (_, shape) in source_variables(path, layout).items()}
    own = {variable_name(v): v.shape.as_list() for v in task.variables}
    extra = sorted(set(saved) - set(own))
    missing = sorted(set(own) - set(saved))
    reshaped = sorted(n for n in set(own) & set(saved) if own[n] != saved[n])
    parts = [f"{what} {listed(names)}" for what, names in (
        ("it holds model variables this model lacks:", extra), ("it lacks", missing),
        ("other shapes:", reshaped)) if names]
    if not parts:
        return None
    run_params = _run_params(path)
    model = _model_of(run_params)
    return "; ".join(parts) + (f"; {run_params} names its model {model}" if model else "")


def listed(names: list[str], shown: int = 3) -> str:
    """The first `shown` of `names`, comma-separated, and how many more there are: names in a one-line message."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _model_of(params_file: str) -> str | None:
    """The `model` line of a run's params.txt (None when there is none)."""
    try:
        with open(params_file, encoding="utf-8") as f:
            for line in f:
                if line.startswith("model :"):
                    return line.split(":", 1)[1].strip().strip("'")
    except OSError:
        return None
    return None


def restore(checkpoint: tf.train.Checkpoint, path: str, partial: bool = False,
            read_elsewhere: Collection[str] = ()) -> None:
    """Restores `path` into `checkpoint`; a checkpoint of another model raises ConfigError.

    `read_elsewhere`: objects of the checkpoint (by their top-level name) that the caller restores through another
    checkpoint object, such as the trainer's weight averages (weight_ema.resume). When they are all that `checkpoint`
    leaves unread, TensorFlow is told so: otherwise it logs, when the objects are dropped, one line per value of
    theirs claiming it "could not be found". The values inside the objects both hold are compared before
    (model_mismatch, optimizer_mismatch).
    """
    layout = saved_layout(path)
    mismatch = model_mismatch(checkpoint, path, layout)
    if mismatch:
        raise ConfigError(f"checkpoint {path} does not match this model ({mismatch}); use the --model of the run "
                          "that wrote it, or a new --logdir")
    other_optimizer = optimizer_mismatch(checkpoint, path, layout)
    if other_optimizer:
        raise ConfigError(other_optimizer)
    # Made before the restore: tf.train.Checkpoint.restore makes its save counter after reading and then restores it
    # from every earlier restore into the same object, so a restore cut short (its files deleted meanwhile, as by a
    # trainer's max_checkpoints_to_keep) would fail the next one with the deleted files' error.
    checkpoint.save_counter  # noqa: B018 -- the property creates the variable
    status = None
    try:
        status = checkpoint.restore(path)
        if partial:
            status.expect_partial()
        else:
            status.assert_existing_objects_matched()
            unmatched = {name for name in layout.top_level if not hasattr(checkpoint, name)}
            if read_elsewhere and unmatched <= set(read_elsewhere):
                status.expect_partial()
    except (tf.errors.InvalidArgumentError, ValueError, AssertionError) as e:
        if status is not None:
            status.expect_partial()  # no warning per unrestored value when the objects are dropped
        # Every tensor of `path` was read back first (restore_latest), so a mismatch here is another model's.
        raise ConfigError(f"checkpoint {path} does not match this model ({_short(e)}); use a new --logdir") from None


def resolve(path: str, what: str = "--checkpoint") -> str:
    """The checkpoint `path` names: a checkpoint prefix (`LOGDIR/checkpoints/ckpt-N`, `.index` optional), or a run's
    logdir or its checkpoints directory (the newest checkpoint there). ConfigError naming `path` otherwise."""
    if path.endswith(".index") and os.path.isfile(path):
        path = path[:-len(".index")]
    if os.path.isdir(path):
        trimmed = path.rstrip(os.sep) or path
        logdir = os.path.dirname(trimmed) if os.path.basename(trimmed) == CHECKPOINT_DIR else trimmed
        found = checkpoint_paths(logdir)
        if not found:
            raise ConfigError(f"{what}={path!r} is a directory without checkpoints (no ckpt-N.index in "
                              f"{checkpoint_dir(logdir)}); name a checkpoint such as LOGDIR/checkpoints/ckpt-100 "
                              "or the logdir of a run that saved one")
        return found[-1]
    if os.path.isfile(path + ".index"):
        return path
    parent = os.path.dirname(path) or "."
    try:
        near = sorted((m.group(0).rsplit(".", 1)[0] for m in map(_FILE_RE.match, os.listdir(parent))
                       if m and m.group(2) == "index"), key=step_of)
    except OSError:
        near = []
    hint = f" ({parent} holds {', '.join(near)})" if near else ""
    raise ConfigError(f"{what}={path!r} names no checkpoint: {path}.index does not exist{hint}; pass a checkpoint "
                      "prefix such as LOGDIR/checkpoints/ckpt-100 (without .index), or a run's logdir for its newest")


def restore_chosen(checkpoint: tf.train.Checkpoint, path: str, what: str = "--checkpoint") -> str:
    """Restores the checkpoint `path` names (see `resolve`) into `checkpoint`, whose objects must all be in it (other
    objects of the file, e.g. optimizer slots, are left unread); returns the checkpoint's path.

    ConfigError naming the path when it names no checkpoint, cannot be read back, or belongs to another model.
    """
    path = resolve(path, what)
    reason = unreadable_reason(path)
    if reason is not None:
        raise ConfigError(f"{what}: checkpoint {path} cannot be read ({reason}); name another checkpoint")
    mismatch = model_mismatch(checkpoint, path)
    if mismatch:
        raise ConfigError(f"{what}: checkpoint {path} does not match this model ({mismatch}); name a checkpoint of "
                          "a run of this model, or use that run's --model")
    status = None
    try:
        status = checkpoint.restore(path)
        status.assert_existing_objects_matched()
        status.expect_partial()
    except (tf.errors.InvalidArgumentError, ValueError, AssertionError) as e:
        if status is not None:
            status.expect_partial()  # no warning per unrestored value when the objects are dropped
        raise ConfigError(f"{what}: checkpoint {path} does not match this model ({_short(e)}); name a checkpoint of "
                          "a run of this model") from None
    return path


def restore_task(task: tf.Module, logdir: str, chosen: str | None, warn: Callable[[str], None]
                 ) -> tuple[str | None, int]:
    """Restores a task's weights for reading (decode, export): from `chosen` (--checkpoint) if given, else the
    newest readable checkpoint in `logdir`. Returns (the path restored or None when there is none, its step)."""
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    restorable = tf.train.Checkpoint(task=task, global_step=global_step)
    if chosen:
        path = restore_chosen(restorable, chosen)
    else:
        path = restore_latest(restorable, logdir, partial=True, warn=warn)
    return path, int(global_step.numpy())
