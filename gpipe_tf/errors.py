"""Errors a user can fix from the command line: each message names the bad value and the fix."""

import os
import traceback


class ConfigError(ValueError):
    """A bad experiment configuration, flag or logdir."""

    ag_pass_through = True  # raised while tf.function traces, it stays a ConfigError (see ParamsError)


class TrainingError(RuntimeError):
    """Training stopped on a failure no setting undoes by itself (NaN loss, a checkpoint that cannot be written)."""


def find_in_chain(error: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `types` in `error`'s chain (itself, then its causes and contexts), or None.

    AutoGraph re-raises an error of code it converted as its StagingError; the original is its context.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def tensor_as_python_value(error: BaseException) -> str | None:
    """One line for TensorFlow's OperatorNotAllowedInGraphError in `error`'s chain (code that used a tensor as a
    Python bool or iterated over one while a step was traced without AutoGraph), naming the user's file and line
    and the ways out; None when the chain holds no such error.

    Matched by class name: this module does not import TensorFlow (the trainer's --help runs without it).
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if type(current).__name__ == "OperatorNotAllowedInGraphError":
            break
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    else:
        return None
    frames = [f for f in traceback.extract_tb(current.__traceback__)
              if f"{os.sep}tensorflow{os.sep}" not in f.filename and f"{os.sep}keras{os.sep}" not in f.filename]
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "a layer"
    return (f"{where} uses a tensor as a Python bool or iterates over it while the step is traced; the trainer "
            "traces without AutoGraph (docs/experiments.md#control-flow-in-a-layer): write it with tf.cond, "
            "tf.where or tf.while_loop, or convert that function with tf.autograph.to_graph")
