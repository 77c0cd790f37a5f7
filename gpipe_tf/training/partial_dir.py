"""Writing a directory all at once: filled under a partial name next to its target, then renamed onto it.

An interrupted writer never leaves a half-written directory at the target. What it may leave is its partial
directory, `<target>.partial-<pid>`: each writer holds an exclusive flock on its partial directory while it
fills it (the kernel drops the lock when the process ends, however it ends), so the next writer removes every
partial directory that is unlocked and whose process is gone, and leaves those of running writers alone.

Write failures (a read-only directory, a full disk) become one `ConfigError` naming the target, the reason and
the fix, whether Python (`OSError`) or TensorFlow's file system (`tf.errors.OpError` naming a file of the partial
directory) reported them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator

import tensorflow as tf

from gpipe_tf.errors import ConfigError

PARTIAL_SUFFIX = ".partial-"


def partial_path(target: str, pid: int | None = None) -> str:
    """The partial directory of `target` written by process `pid` (default: this one)."""
    return f"{target.rstrip(os.sep)}{PARTIAL_SUFFIX}{os.getpid() if pid is None else pid}"


def write_atomically(target: str, write: Callable[[str], None], fix: str, clean_parent: bool = False) -> list[str]:
    """Calls `write(partial)` to fill a new partial directory of `target`, then renames it to `target`; returns
    the stale partial directories it removed.

    `target` must not exist or be an empty directory. Stale partial directories are removed first: those of
    `target`, or with `clean_parent` (a parent that holds only such directories), every one in `target`'s parent.
    A write that fails on the file system raises ConfigError("cannot write to <target>: <reason>; <fix>") and
    leaves no partial directory behind; any other error propagates unchanged, also leaving none.
    """
    target = target.rstrip(os.sep)
    parent = os.path.dirname(os.path.abspath(target))
    basename = os.path.basename(target)
    partial = partial_path(target)
    try:
        os.makedirs(parent, exist_ok=True)
        removed = remove_stale(parent, None if clean_parent else basename)
        with _locked_new_dir(partial):
            _probe(partial)
            write(partial)
            if os.path.isdir(target):
                os.rmdir(target)  # an empty directory only: rmdir refuses any other
            os.replace(partial, target)
        return removed
    except (OSError, tf.errors.OpError) as e:
        reason = _file_system_reason(e, partial)
        if reason is None:
            raise
        raise ConfigError(f"cannot write to {target}: {reason}; {fix}") from None
    finally:
        if os.path.lexists(partial):
            shutil.rmtree(partial)


def remove_stale(parent: str, basename: str | None = None) -> list[str]:
    """Removes the partial directories in `parent` left by writers that are gone; returns their paths.

    Candidates are those of `basename` (`<basename><PARTIAL_SUFFIX><pid>`), or with None every
    `<name><PARTIAL_SUFFIX><pid>`. One is stale when its process is not running here and nothing holds its lock.
    """
    name_pattern = ".+" if basename is None else re.escape(basename)
    pattern = re.compile(name_pattern + re.escape(PARTIAL_SUFFIX) + r"(\d+)")
    removed = []
    for name in sorted(os.listdir(parent)):
        match = pattern.fullmatch(name)
        path = os.path.join(parent, name)
        if match is None or not os.path.isdir(path) or os.path.islink(path):
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _running(pid) or not _unlocked(path):
            continue
        shutil.rmtree(path)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlocked(path: str) -> bool:
    """Whether no process holds the flock of directory `path` (briefly taking it to find out)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also releases the lock if taken
    return True


@contextlib.contextmanager
def _locked_new_dir(path: str) -> Iterator[None]:
    """Creates directory `path` (an old one of this pid, from a reused pid, is replaced) and holds its flock."""
    if os.path.lexists(path):
        shutil.rmtree(path)
    os.mkdir(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def _probe(directory: str) -> None:
    """Writes 4 KiB in `directory`: a directory that refuses writes, or a disk too full for a block, fails here."""
    path = os.path.join(directory, ".write_test")
    try:
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
    finally:
        if os.path.lexists(path):
            os.remove(path)


def _file_system_reason(error: BaseException, partial: str) -> str | None:
    """The reason of a file-system failure in one line ('Permission denied'), or None for any other error."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    message = error.message if isinstance(error, tf.errors.OpError) else str(error)
    if partial not in message:
        return None  # not a file of this write: a bug, not the user's disk
    # TensorFlow's I/O messages read "{{function_node ...}} <file>; <strerror> [Op:SaveV2]".
    message = re.sub(r"\s*\[Op:\w+\]\s*$", "", message)
    return " ".join(message.rsplit("; ", 1)[-1].split())
