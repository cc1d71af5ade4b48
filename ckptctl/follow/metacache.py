"""A waiting DCP save's ``.metadata``, parsed once per version of the file, not at every look.

A save waits for its quiet period, or for a rank's file that ``.metadata`` names, for many looks;
each look used to read and parse ``.metadata`` in full (tens of MB for a large model's save).
:class:`MetadataCache` (one per follower, at most :data:`LIMIT` files) keeps what completion needs
from it (every storage file it names with the furthest byte read from it, the save id, or why it
cannot be read) keyed by the file's (device, inode, size, mtime_ns), taken by ``lstat`` before
the read: a file replaced or rewritten has another key and is read again (a rewrite between the
``lstat`` and the read is stored under the old key, and read again at the next look). An
``OSError`` is never kept. :func:`read_fresh` is the reference, used at every look when the cache
is off (``CKPTCTL_FAST_FOLLOW_METADATA=0``, or ``judge`` called without one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIMIT = 256


@dataclass(frozen=True)
class ReadMetadata:
    error: str | None  # why it cannot be used (then nothing else is set)
    needs: tuple[tuple[Any, int], ...] = ()  # (relative_path as stored, end of the furthest byte read)
    save_id: Any = None


def read_fresh(path: Path) -> ReadMetadata:
    """``path`` read and parsed now (the allow-list reader). Raises OSError."""
    from ckptctl.format.dcp_metadata import read_dcp_metadata, storage_needs

    md, findings = read_dcp_metadata(path, str(path))
    if md is None:
        return ReadMetadata(findings[0].message if findings else f"{path.name} unreadable")
    sm = getattr(md, "storage_meta", None)
    return ReadMetadata(None, tuple((n.relative_path, n.end) for n in storage_needs(md)),
                        getattr(sm, "save_id", None) if sm is not None else None)


class MetadataCache:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self.entries: dict[str, tuple[tuple[int, int, int, int], ReadMetadata]] = {}
        self.reads = 0  # files read and parsed (for tests and measures)

    @classmethod
    def if_enabled(cls) -> MetadataCache | None:
        from ckptctl.fastpaths import enabled

        return cls() if enabled("follow-metadata") else None

    def read(self, path: Path) -> ReadMetadata:
        """As :func:`read_fresh`, from the cache when the file is the version read last."""
        st = os.lstat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        name = os.fspath(path)
        hit = self.entries.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        self.reads += 1
        got = read_fresh(path)
        self.entries.pop(name, None)
        self.entries[name] = (key, got)
        while len(self.entries) > self.limit:
            del self.entries[next(iter(self.entries))]
        return got
