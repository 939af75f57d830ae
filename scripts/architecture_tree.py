"""Print docs/architecture.md's package tree from the modules' docstrings (each line: the docstring's first
sentence), packages in layer order, bottom first: ``python scripts/architecture_tree.py --write`` rewrites
the page's tree in place; without ``--write`` the tree is printed."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "neva_pack"
LAYERS = ("core", "files", "records", "text", "families", "sample_store", "samples", "packing", "assembly",
          "formats", "reading", "training", "integrations", "config", "commands", "pipeline")  # fmt: skip
"""The packages from the bottom up: a package imports only packages before it (tests/project/test_architecture.py)."""
WIDTH = 120


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split())
    end = text.find(". ")
    sentence = text if end < 0 else text[: end + 1].rstrip(".")
    return sentence.rstrip(".")


def line(indent: str, name: str, path: Path) -> str:
    text = f"{indent}{name:<{26 - len(indent)}}{first_sentence(path)}"
    return text if len(text) <= WIDTH else text[: WIDTH - 2].rstrip() + " …"


def tree() -> str:
    lines = ["neva_pack/"]
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            lines.append(line("  ", path.name, path))
    packages = sorted((p.parent.name for p in PACKAGE.glob("*/__init__.py")), key=lambda n: (n not in LAYERS, LAYERS.index(n) if n in LAYERS else 0, n))
    for name in packages:
        lines.append(line("  ", name + "/", PACKAGE / name / "__init__.py"))
        for path in sorted((PACKAGE / name).glob("*.py")):
            if path.name != "__init__.py":
                lines.append(line("    ", path.name, path))
    return "\n".join(lines) + "\n"


def main() -> None:
    text = tree()
    if "--write" not in sys.argv:
        print(text, end="")
        return
    page = ROOT / "docs" / "architecture.md"
    content = page.read_text(encoding="utf-8")
    start = content.index("```\nneva_pack/\n") + 4
    end = content.index("```", start)
    page.write_text(content[:start] + text + content[end:], encoding="utf-8")


if __name__ == "__main__":
    main()
