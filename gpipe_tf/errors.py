"""Errors a user can fix from the command line: each message names the bad value and the fix."""

import os
import traceback
from collections.abc import Iterator


class ConfigError(ValueError):
    """A bad experiment configuration, flag or logdir."""

    ag_pass_through = True  # raised while tf.function traces, it stays a ConfigError (see ParamsError)


class TrainingError(RuntimeError):
    """Training stopped on a failure no setting undoes by itself (NaN loss, a checkpoint that cannot be written)."""


def chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then the errors it came from (each one's cause, else its context), each once.

    AutoGraph re-raises an error of code it converted as its StagingError; the original is its context.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


def find_in_chain(error: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `types` in `error`'s `chain`, or None."""
    return next((e for e in chain(error) if isinstance(e, types)), None)


def tensor_as_python_value(error: BaseException) -> str | None:
    """One line for TensorFlow's OperatorNotAllowedInGraphError in `error`'s chain (code that used a tensor as a
    Python bool or iterated over one while a step was traced without AutoGraph), naming the innermost file and line
    outside TensorFlow and the ways out; None when the chain holds no such error.

    Matched by class name: this module does not import TensorFlow (the trainer's --help runs without it).
    """
    found = next((e for e in chain(error) if type(e).__name__ == "OperatorNotAllowedInGraphError"), None)
    if found is None:
        return None
    frames = [f for f in traceback.extract_tb(found.__traceback__)
              if f"{os.sep}tensorflow{os.sep}" not in f.filename and f"{os.sep}keras{os.sep}" not in f.filename]
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "a layer"
    return (f"{where} uses a tensor as a Python bool or iterates over it while the step is traced; the trainer "
            "traces without AutoGraph (docs/experiments.md#control-flow-in-a-layer): write it with tf.cond, "
            "tf.where or tf.while_loop, or convert that function with tf.autograph.to_graph")
