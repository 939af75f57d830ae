"""Where numba keeps the compiled kernels of ``cache=True``: a per-user cache directory, never the
package's own folder.

numba's default writes ``.nbi``/``.nbc`` files into a ``__pycache__`` beside each module. In a
regular install that is ``site-packages/neva_pack/...``; pip does not know those files, so
``pip uninstall`` (which ``pip install -e .`` runs over a regular install: the README's command 2
after command 1) leaves ``site-packages/neva_pack/`` holding only ``__pycache__`` folders. A folder
without ``__init__.py`` on ``sys.path`` is a namespace package, and Python's path finder returns it
before the editable install's finder is asked: ``neva-pack --help`` then fails with "cannot import
name ... (unknown location)" from any directory but the checkout.

So, unless the user chose a directory (``NUMBA_CACHE_DIR`` set, honoured as is), the cache goes to
``$XDG_CACHE_HOME/neva_pack/numba`` (``~/.cache/neva_pack/numba``), or a per-user folder under the
temporary directory when that cannot be made. numba keys each module's entries by the module's full
path, so two installs or checkouts never read each other's kernels. This runs from ``neva_pack.core``,
which every neva_pack import runs first, before any kernel module is decorated; the environment
variable also reaches worker processes. numba reads its environment when it is imported and again
before each compilation, but picks a function's cache folder when the function is decorated: if
numba was imported before neva_pack, its configuration is reloaded here so our kernels see the
folder.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

__all__ = ["NUMBA_CACHE_VARIABLE", "use_user_numba_cache"]

NUMBA_CACHE_VARIABLE = "NUMBA_CACHE_DIR"


def _user_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # RuntimeError: Path.home() without a home
        return False
    return os.access(path, os.W_OK | os.X_OK)


def use_user_numba_cache() -> str:
    """Point numba's kernel cache at a per-user folder unless ``NUMBA_CACHE_DIR`` is already set;
    returns the folder in use ("" when none could be made: numba then caches where it would)."""
    chosen = os.environ.get(NUMBA_CACHE_VARIABLE)
    if chosen:
        return chosen
    candidates = []
    try:
        candidates.append(_user_cache_root() / "neva_pack" / "numba")
    except RuntimeError:
        pass
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    candidates.append(Path(tempfile.gettempdir()) / f"neva_pack-numba-{user}")
    for candidate in candidates:
        if _writable_dir(candidate):
            os.environ[NUMBA_CACHE_VARIABLE] = str(candidate)
            numba_config = sys.modules.get("numba.core.config")
            if numba_config is not None:
                numba_config.reload_config()
            return str(candidate)
    return ""
