"""Exceptions that carry a one-line message for the user.

Programming errors are never wrapped in these: only what a user can fix (an argument,
a file) becomes a ``NevaPackError``; the CLI prints its message on one line.
"""


class NevaPackError(Exception):
    """Base of every error the command line reports as one line (exit code 2)."""


class ConfigError(NevaPackError):
    """A bad argument, path or setting, found before any work starts."""


class InputError(NevaPackError):
    """An input file that cannot be read at all (not one bad record: those are skipped)."""


class OutputError(NevaPackError):
    """The run's own output failed a check before publishing (a bug, not a bad input): nothing was published."""
