"""Session fixtures over the corpus. Enable in a test module with ``pytest_plugins = ["ecosystem.fixtures"]``.

* ``build_one``: ``build_one(name) -> Path``, the entry built on first use and reused for the
  whole session (a library that is not installed skips the calling test, naming it).
* ``ecosystem``: ``{name: Path}`` of every entry whose libraries are installed, all built.

The directories are shared by every test of the session: treat them as read-only and
``fresh_copy`` one before changing it. Builds live under pytest's session temporary directory
(``<basetemp>/ecosystem/<dirname(name)>``) and are cached on the pytest config, so every test
module that enables the plugin shares the same builds.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Callable

import pytest

from . import ENTRIES, RECIPES, build, dirname, missing_libraries

_BUILT = pytest.StashKey[dict[str, Path]]()
_LOCK = threading.Lock()


class Builder:
    """Builds entries into one root, each at most once."""

    def __init__(self, root: Path, built: dict[str, Path]) -> None:
        self.root, self.built = root, built

    def __call__(self, name: str) -> Path:
        missing = missing_libraries(name)
        if missing:
            pytest.skip(f"{name} needs {', '.join(missing)}, not installed")
        return self._build(name)

    def _build(self, name: str) -> Path:
        with _LOCK:
            path = self.built.get(name)
        if path is None:
            path = build(name, self.root / dirname(name))
            with _LOCK:
                self.built[name] = path
        return path

    def all(self) -> dict[str, Path]:
        """Every buildable entry; the ones that run subprocesses are started first, in threads, so their
        ranks run while this process builds the others."""
        names = [e.name for e in ENTRIES if not missing_libraries(e.name)]
        spawning = [n for n in names if RECIPES[n].spawns and n not in self.built]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(spawning))) as pool:
            futures = [pool.submit(self._build, n) for n in spawning]
            for n in names:
                if n not in spawning:
                    self._build(n)
            for f in futures:
                f.result()
        return {n: self.built[n] for n in names}


@pytest.fixture(scope="session")
def build_one(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``build_one(name) -> Path``: the built (read-only by convention) directory of one entry."""
    stash = request.config.stash
    if _BUILT not in stash:
        stash[_BUILT] = {}
    return Builder(tmp_path_factory.getbasetemp() / "ecosystem", stash[_BUILT])


@pytest.fixture(scope="session")
def ecosystem(build_one: Builder) -> dict[str, Path]:
    """Every entry whose libraries are installed, built: name -> directory (read-only by convention)."""
    return build_one.all()
