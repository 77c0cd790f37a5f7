"""Errors a user can fix from the command line: each message names the bad value and the fix."""


class ConfigError(ValueError):
    """A bad experiment configuration, flag or logdir."""
