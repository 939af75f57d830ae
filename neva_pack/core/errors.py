"""Exceptions that carry a one-line message for the user.

Programming errors are never wrapped in these: only what a user can fix (an argument,
a file) becomes a ``NevaPackError``; the CLI prints its message on one line.
"""

from contextlib import contextmanager


class NevaPackError(Exception):
    """Base of every error the command line reports as one line (exit code 2)."""


class ConfigError(NevaPackError):
    """A bad argument, path or setting, found before any work starts."""


class InputError(NevaPackError):
    """An input file that cannot be read at all (not one bad record: those are skipped)."""


class OutputError(NevaPackError):
    """The run's own output failed a check before publishing (a bug, not a bad input): nothing was published."""


_PARSE_FAILURES = (ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError, SyntaxError)
"""How json, numpy and our ``from_json``/``from_arrays`` fail on a damaged file (a JSON or
UnicodeDecodeError is a ValueError; numpy's truncated archive is a zipfile.BadZipFile, added below;
a ``.npy`` header edited is a SyntaxError or tokenize's TokenError from its literal_eval, added below)."""


@contextmanager
def parsing(path):
    """Where a file of an output is parsed (meta, plan table, index, stats.json, skipped list):
    turns the ways a damaged one fails to parse into one InputError naming it. verify, stats and
    convert read the same files, so they refuse a damaged one alike, with one line, not a traceback."""
    import tokenize
    import zipfile

    try:
        yield
    except InputError:
        raise
    except (*_PARSE_FAILURES, zipfile.BadZipFile, tokenize.TokenError) as exc:
        raise InputError(f"{path}: damaged (not as neva_pack writes it: {exc.__class__.__name__}: {exc})") from None
