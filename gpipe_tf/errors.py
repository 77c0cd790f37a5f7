"""Errors a user can fix from the command line: each message names the bad value and the fix."""


class ConfigError(ValueError):
    """A bad experiment configuration, flag or logdir."""


class TrainingError(RuntimeError):
    """Training stopped on a failure no setting undoes by itself (NaN loss, a checkpoint that cannot be written)."""
