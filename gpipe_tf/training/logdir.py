"""The run directory: created and checked before any work, holding the resolved Params of its model.

A logdir belongs to one model: a second run may change training settings (max_steps, learning rate) but not
the model key or the task's Params (shapes), since its checkpoints could not be restored into another model.
"""

from __future__ import annotations

import os
import tempfile

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import Params, ParamsError

PARAMS_FILE = "params.txt"
CHECKPOINT_DIR = "checkpoints"


def check_writable(logdir: str) -> None:
    """Creates `logdir` if needed and checks a file can be written there; ConfigError otherwise."""
    try:
        os.makedirs(logdir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=logdir, prefix=".write_test"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write to --logdir={logdir!r} ({e.strerror or e}); "
                          "pass a directory you can write to") from None


def _incompatible_fields(old: Params, new: Params) -> list[str]:
    lines = []
    if old.get("model") != new.get("model"):
        lines.append(f"model: {old.get('model')} -> {new.get('model')}")
    if "task" in old and "task" in new:
        lines += [f"task.{line}" for line in old.get("task").diff(new.get("task"))]
    return lines


def check_compatible(logdir: str, params: Params) -> None:
    """Refuses a logdir whose saved Params belong to another model or another task shape."""
    path = os.path.join(logdir, PARAMS_FILE)
    if not os.path.exists(path):
        has_ckpt = os.path.isdir(os.path.join(logdir, CHECKPOINT_DIR)) and os.listdir(
            os.path.join(logdir, CHECKPOINT_DIR))
        if has_ckpt:
            raise ConfigError(f"--logdir={logdir!r} holds checkpoints but no {PARAMS_FILE}, so they cannot be "
                              "checked against this model; use a new --logdir")
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        old = Params.from_text(text)
    except (ParamsError, ImportError, AttributeError) as e:
        raise ConfigError(f"cannot read {path} ({e}); use a new --logdir") from None
    differences = _incompatible_fields(old, params)
    if differences:
        shown = "; ".join(differences[:5]) + (f"; ... {len(differences) - 5} more" if len(differences) > 5 else "")
        raise ConfigError(f"--logdir={logdir!r} holds another model's run ({shown}); use a new --logdir or "
                          "the same model settings")


def write_params(logdir: str, params: Params) -> None:
    """Writes the resolved Params to logdir/params.txt atomically (a crash never leaves half a file)."""
    path = os.path.join(logdir, PARAMS_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(params.to_text())
    os.replace(tmp, path)


def prepare(logdir: str, params: Params) -> None:
    """Checks the logdir can be written and belongs to this model, then records the Params."""
    check_writable(logdir)
    check_compatible(logdir, params)
    write_params(logdir, params)
