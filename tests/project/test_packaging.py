"""The installed package is the whole package: a subpackage missing from pyproject.toml works in an
editable checkout and vanishes from `pip install .` (the README's first command)."""

from __future__ import annotations

import tomllib

from tests.conftest import ROOT


def test_every_subpackage_is_declared_for_a_regular_install():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "neva_pack").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }  # fmt: skip
    assert on_disk <= declared, sorted(on_disk - declared)


def test_the_trainer_recipes_extra_installs_accelerate_and_the_recipe_says_so():
    """The Hugging Face Trainer needs accelerate, which transformers does not pull in: the ``hf``
    extra declares it, and the page of the recipes names the extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("accelerate>=") for requirement in extras["hf"])
    page = (ROOT / "docs" / "training_hugging_face.md").read_text()
    assert "pip install 'neva-pack[hf]'" in page
    assert page.index("pip install 'neva-pack[hf]'") < page.index("from transformers import Trainer")
