"""Headers parsed ahead of their use, handed out once to the read that asks for the same file.

``layout.scan`` parses a large index in a worker process (:mod:`ckptctl.worker`) and the shard
headers meanwhile, before anyone asks for them. A header read ahead is kept here under the path
and display it was read with and the identity of the file it came from (device, inode, size,
mtime and ctime in nanoseconds, from ``fstat`` of the descriptor it was read through).
:func:`ckptctl.format.header.read_header` opens and fstats the file as always and takes the
kept header only when that identity is unchanged: a file replaced, rewritten or truncated since
is parsed again. Each header is handed out once (the caller owns it, as a fresh parse).

Reading ahead happens only in a scan of the directory of an open :func:`scope`, which a command
opens around the work that reads the headers of the directory it scans (verify of a path,
inspect, resave, the source of an export); leaving the outermost scope drops whatever was not
asked for, so nothing stays in memory after the command's work.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from ckptctl.format.header import Header

Identity = tuple[int, int, int, int, int]
# What a command draws from the names of an index alone: called by a scan's worker with the
# index's joins (each shard's names, sorted and joined by newlines), its result handed back with
# the index (``Index.facts``). A function of the names only, so that it may run before anyone
# knows whether the shards hold the same names (the caller uses it only once that is proved).
NamesWork = Callable[[dict[str, str]], Any]

_lock = threading.Lock()
_roots: list[str] = []  # the directories of the open scopes (absolute)
_work: dict[str, "NamesWork"] = {}  # a scope's work on an index's names, by its directory
_kept: dict[tuple[str, str], tuple[Identity, "Header"]] = {}


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@contextmanager
def scope(root: str | os.PathLike[str], *, names_work: NamesWork | None = None) -> Iterator[None]:
    """Scans of the directory ``root`` may read ahead inside (a command's other scans, of an
    export's destination say, never do); the outermost exit drops the headers nobody took.
    ``names_work``: what the worker of a scan of ``root`` computes from its index's names."""
    key = os.path.abspath(root)
    with _lock:
        _roots.append(key)
        before = _work.get(key)
        if names_work is not None:
            _work[key] = names_work
    try:
        yield
    finally:
        with _lock:
            _roots.remove(key)
            if names_work is not None:
                if before is None:
                    del _work[key]
                else:
                    _work[key] = before
            if not _roots:
                _kept.clear()


def wanted(root: str | os.PathLike[str]) -> bool:
    """Whether a scan of ``root`` should read its headers ahead."""
    return bool(_roots) and os.path.abspath(root) in _roots


def names_work(root: str | os.PathLike[str]) -> NamesWork | None:
    """The work on an index's names that the open scope of ``root`` asked for, if any."""
    return _work.get(os.path.abspath(root)) if _work else None


def keep(path: str, display: str, ident: Identity, hdr: "Header") -> None:
    """Keep ``hdr``, read from ``path`` when it had the identity ``ident``, for one read."""
    with _lock:
        if _roots:
            _kept[(path, display)] = (ident, hdr)


def take(path: str, display: str, st: os.stat_result) -> "Header | None":
    """The header kept for this file, if it is still the file it was read from."""
    if not _kept:
        return None
    with _lock:
        got = _kept.pop((path, display), None)
    if got is None or got[0] != identity(st):
        return None
    return got[1]
