"""The README's and docs' fenced code stays true to the tool: every ```python block compiles, and
every command line of a ```bash block that runs neva-pack (``neva-pack ...``, ``python -m
neva_pack.cli ...``, ``python scripts/preprocess_dataset.py ...``) is accepted by the real argument
parser, so a renamed flag, a choice that is gone or a typo in the docs fails here. What a doc elides is
written ``...`` (dropped) and a shell variable stands for a number (``$i`` -> 0). This checks the
commands' flags and the snippets' syntax; it does not run them (most need a model, GPUs or a
training framework)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest

from neva_pack.cli import build_parser
from tests.conftest import ROOT

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
STARTS = (("neva-pack",), ("python", "-m", "neva_pack.cli"), ("python", "scripts/preprocess_dataset.py"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(language: str) -> list[tuple[str, str]]:
    """(where, text) of every fenced block of ``language`` in the README and docs/."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text[: match.start()].count("\n") + 1
                found.append((f"{path.relative_to(ROOT)}:{line}", match.group(2)))
    return found


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every neva-pack command line in a bash block, as ``main`` would get it."""
    found = []
    for where, body in blocks("bash"):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("#"):
                continue
            for part in re.split(r"&&|;|\|\|", line):
                try:
                    words = shlex.split(part.split(" | ")[0])
                except ValueError:
                    continue
                words = ["0" if re.fullmatch(r"\$\{?\w+\}?", w) else w for w in words if w != "..." and not re.match(r"^\d?>", w)]
                for start in STARTS:
                    if tuple(words[: len(start)]) == start:
                        argv = words[len(start) :]
                        found.append((where, ["preprocess", *argv] if start[-1].endswith(".py") else argv))
    return found


COMMANDS = commands()
SNIPPETS = blocks("python")


def test_the_docs_hold_commands_and_snippets():
    assert len(COMMANDS) >= 10 and len(SNIPPETS) >= 10  # the extraction finds them (a fence change would hide them)


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[f"{where}:{' '.join(argv)[:40]}" for where, argv in COMMANDS])
def test_every_documented_command_line_is_accepted_by_the_parser(where, argv):
    error = io.StringIO()
    with contextlib.redirect_stderr(error), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit_:
            assert not exit_.code, f"{where}: neva-pack {' '.join(argv)}: {error.getvalue().strip()}"


@pytest.mark.parametrize(("where", "text"), SNIPPETS, ids=[where for where, _ in SNIPPETS])
def test_every_documented_python_snippet_compiles(where, text):
    compile(text, where, "exec")
