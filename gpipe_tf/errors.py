"""Errors a user can fix from the command line: each message names the bad value and the fix."""


class ConfigError(ValueError):
    """A bad experiment configuration, flag or logdir."""

    ag_pass_through = True  # raised while tf.function traces, it stays a ConfigError (see ParamsError)


class TrainingError(RuntimeError):
    """Training stopped on a failure no setting undoes by itself (NaN loss, a checkpoint that cannot be written)."""


def find_in_chain(error: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `types` in `error`'s chain (itself, then its causes and contexts), or None.

    tf.function tracing re-raises an error of user code as autograph's StagingError; the original is its context.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
