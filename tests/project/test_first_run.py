"""The first run as a new user meets it: the README's install commands, in order, leave a working tool.

numba's ``cache=True`` kernels wrote their cache beside the modules; after ``pip install .`` those
files stayed in ``site-packages/neva_pack/`` when ``pip install -e .`` uninstalled it, and formed a
namespace package that shadowed the editable install. The kernels now cache in a per-user folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

_WHERE_KERNELS_CACHE = (
    "import os, numba; {before}"
    "from neva_pack.packing import kernels; "
    "print(os.environ.get('NUMBA_CACHE_DIR')); print(kernels.group_by_bin._cache._cache_path)"
)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH", "XDG_CACHE_HOME")}
    env.update(extra)
    return env


def _kernel_cache(tmp_path, before: str = "", **env) -> tuple[str, str]:
    result = subprocess.run([sys.executable, "-c", _WHERE_KERNELS_CACHE.format(before=before)],
                            cwd=tmp_path, env=_clean_env(PYTHONPATH=str(ROOT), **env),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    variable, path = result.stdout.split("\n")[:2]
    return variable, path


def test_kernels_cache_in_a_per_user_folder_not_beside_the_package(tmp_path):
    variable, path = _kernel_cache(tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert variable == str(tmp_path / "cache" / "neva_pack" / "numba")
    assert Path(path).is_relative_to(tmp_path / "cache")
    assert not Path(path).is_relative_to(ROOT / "neva_pack")


def test_a_users_own_numba_cache_dir_is_kept(tmp_path):
    variable, path = _kernel_cache(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "mine"), XDG_CACHE_HOME=str(tmp_path / "c"))
    assert variable == str(tmp_path / "mine") and Path(path).is_relative_to(tmp_path / "mine")


def test_numba_imported_before_neva_pack_still_caches_in_the_user_folder(tmp_path):
    _, path = _kernel_cache(tmp_path, before="numba.njit(lambda: 0); ", XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert Path(path).is_relative_to(tmp_path / "cache")


def _copy_project(to: Path) -> Path:
    """The checkout's tracked sources, without its build leftovers or caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.egg-info", "build", "dist")
    for name in ("neva_pack", "templates"):
        shutil.copytree(ROOT / name, to / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, to / name)
    return to


@pytest.mark.slow
def test_regular_install_then_editable_install_leaves_a_working_tool(tmp_path):
    """README command 1 (``pip install .``, then a run that compiles kernels), then command 2
    (``pip install -e .``), then ``neva-pack --help`` from another directory."""
    project = _copy_project(tmp_path / "clone")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    # The dependencies (numpy, numba, pip, setuptools, ...) come from this interpreter's site-packages,
    # added as a plain path: no re-download, and its own .pth files (an editable neva_pack) unread.
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _clean_env(HOME=str(tmp_path / "home"), PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def run(*args, cwd=elsewhere):
        result = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout

    pip = ("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet")
    run(*pip, ".", cwd=project)
    installed = site / "neva_pack"
    assert (installed / "__init__.py").is_file()
    run("-c", "import numpy as np; from neva_pack.packing import pack; "
              "print(pack(np.array([3, 5, 2, 7]), 8, algorithm='first_fit_decreasing').num_bins)")  # fmt: skip
    assert not list(installed.rglob("*.nbi")), "numba cached kernels inside site-packages"
    run(*pip, "-e", ".", cwd=project)
    assert not installed.exists(), sorted(str(p) for p in installed.rglob("*"))
    result = subprocess.run([str(venv / "bin" / "neva-pack"), "--help"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "preprocess" in result.stdout
