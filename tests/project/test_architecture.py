"""The package's shape: no import cycle (module level or inside functions), every module importable
first in a fresh interpreter, and no module outside formats/ that imports a format's own module
(they ask the registry, ``neva_pack.formats``)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import neva_pack
from neva_pack.formats import FORMATS

PACKAGE = Path(neva_pack.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(tree: ast.AST) -> list[str]:
    """The neva_pack modules a module imports, wherever the import statement stands: module level, in
    a function, or under ``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader
    follows, and the cycle it closes is still a cycle of the design)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append(submodule if submodule in MODULES else node.module)
    return [name for name in found if name in MODULES]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules importing it runs: what it imports, and the packages of those that it is
    not inside of (importing neva_pack.formats.nemo from outside runs formats/__init__.py)."""
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for target in imported(ast.parse(path.read_text(encoding="utf-8"))):
            parts = target.split(".")
            for k in range(2, len(parts) + 1):
                ancestor = ".".join(parts[:k])
                inside = name == ancestor or name.startswith(ancestor + ".")
                if ancestor in MODULES and ancestor != name and (ancestor == target or not inside):
                    edges.add(ancestor)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle or several."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_or_type_checking_import():
    tree = ast.parse("import os\ndef f():\n    from neva_pack.formats import nemo\n")
    assert imported(tree) == ["neva_pack.formats.nemo"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from neva_pack.formats import nemo\n")
    assert imported(tree) == ["neva_pack.formats.nemo"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


LAYERS = (
    "core", "files", "records", "text", "families", "sample_store", "samples", "packing", "assembly",
    "formats", "reading", "training", "integrations", "config", "commands", "pipeline",
)  # fmt: skip
"""The layer packages from the bottom up (docs/architecture.md draws them): a package imports only
packages before it. The root (``neva_pack/__init__.py``, ``cli.py``) stands above them all."""


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and MODULES[module].name == "__init__.py") else None


def test_the_package_root_holds_only_the_public_face_and_the_command_line():
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py"]
    packages = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    assert sorted(LAYERS) == packages


def test_every_package_imports_only_the_layers_below_it():
    """No package-level cycle, lazy and TYPE_CHECKING imports counted: each layer reads only the ones
    before it in LAYERS."""
    climbing = set()
    for name, targets in import_graph().items():
        source = package_of(name)
        if source is None:
            continue
        for target in targets:
            dest = package_of(target)
            if dest is not None and dest != source and LAYERS.index(dest) > LAYERS.index(source):
                climbing.add(f"{name} -> {target}")
    assert sorted(climbing) == []


def test_every_package_has_a_face():
    """Each package's __init__ declares ``__all__``, and every name in it is there."""
    import importlib

    for layer in LAYERS:
        package = importlib.import_module(f"neva_pack.{layer}")
        assert isinstance(package.__all__, list), layer
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert missing == [], layer


def test_the_public_face_names_the_documented_entry_points():
    import neva_pack

    for name in ("preprocess", "pack", "PackedSeqDataset", "open_packed", "PreprocessConfig", "hf_collate", "verify"):
        assert name in neva_pack.__all__
        assert getattr(neva_pack, name) is not None


def test_no_module_outside_formats_imports_a_formats_own_module():
    """A format is one module plus one registry line: the rest of the package asks the registry."""
    format_modules = {type(fmt).__module__ for fmt in FORMATS.values()}
    assert format_modules, "no registered format"
    offenders = {name: sorted(targets & format_modules) for name, targets in import_graph().items()
                 if not name.startswith("neva_pack.formats") and targets & format_modules}  # fmt: skip
    assert offenders == {}


def first_import(module: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=PACKAGE.parent)


FORMATS_LAYER = sorted(name for name in MODULES if name.startswith("neva_pack.formats"))
FORMATS_LAYER += ["neva_pack.files.paths", "neva_pack.files.checksums", "neva_pack.packing.plan_table", "neva_pack.assembly.assemble"]


FIRST_IMPORTS_BY_DEFAULT = ("neva_pack.formats", "neva_pack.assembly.assemble")
"""The registry and the top of the formats layer (it imports the rest first); every other module's own
first import runs with -m slow: no_import_cycle and the layer order above already rule a cycle out."""


@pytest.mark.parametrize(
    "module", [m if m in FIRST_IMPORTS_BY_DEFAULT else pytest.param(m, marks=pytest.mark.slow) for m in FORMATS_LAYER]
)
def test_each_module_of_the_formats_layer_imports_first_in_a_fresh_interpreter(module):
    result = first_import(module)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(set(MODULES) - set(FORMATS_LAYER) - {"neva_pack.__main__"}))  # that one runs the CLI
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    result = first_import(module)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_architecture_page_lists_every_module_of_the_package():
    """docs/architecture.md's package tree is the newcomer's map: a module added, moved or renamed
    without its line there is a map that lies."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    tree = page[page.index("```\nneva_pack/\n") + 4 :]
    tree = tree[: tree.index("```")].splitlines()[1:]
    listed, package = set(), None
    for line in tree:
        name = line.split()[0]
        if line.startswith("    "):
            listed.add(f"{package}/{name}")
        else:
            package = name.rstrip("/")
            listed.add(package + ("/__init__.py" if name.endswith("/") else ""))
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__main__.py" and path.relative_to(PACKAGE).as_posix() != "__init__.py"
    }
    assert listed == modules
