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
    """The neva_pack modules a module imports, at module level or in a function; ``if TYPE_CHECKING:``
    blocks left out (they never run)."""
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    submodule = f"{child.module}.{alias.name}"
                    found.append(submodule if submodule in MODULES else child.module)
            visit(child)

    visit(tree)
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


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    tree = ast.parse("import os\ndef f():\n    from neva_pack.formats import nemo\n")
    assert imported(tree) == ["neva_pack.formats.nemo"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


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


@pytest.mark.parametrize("module", FORMATS_LAYER)
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
