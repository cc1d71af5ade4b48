"""What one command reads of a checkpoint's metadata, read once and kept for that command.

A command creates one :class:`MetadataReading` and passes it down (``layout.scan(path,
reading=...)``, the export job, resave's analysis, verify's context). It is the only place where
metadata outlives one call, so what a read returns never depends on what else the process did:

- an **index** is kept with the bytes it was parsed from; a later read of the same path (the
  export's source scanned for the root test and again as the source, a repair's analysis and its
  no-op test) reads the file again, bounded, and parses only when the bytes differ (never judged
  by a size or a time stamp). Each read gets its own :meth:`Index.copy`.
- a **header** is parsed every time it is read (a parse of 564 entries takes about half a
  millisecond, and a shard rewritten in place must be seen as it is now).

``fast`` switches every metadata fast path at once: orjson for the index
(:func:`ckptctl.format.index.parse_index`) and the typed header decoder
(:func:`ckptctl.format.header.read_header`). With ``fast=False`` only the reference readers run.
Left unset, it is on unless the environment says ``CKPTCTL_FAST_METADATA=0`` (how a command line,
and the suite's runs of the commands with the reference readers, turn it off); the suite runs
the commands both ways and compares their documents byte for byte.
"""

from __future__ import annotations

import os

from ckptctl.fastpaths import enabled
from ckptctl.format.header import Header, read_header
from ckptctl.format.index import Index, parse_index, read_index_bytes




class MetadataReading:
    """One command's reading of checkpoint metadata (see the module's docstring)."""

    def __init__(self, *, fast: bool | None = None) -> None:
        self.fast = enabled("metadata") if fast is None else fast
        # (path, display) -> (the bytes read, the Index parsed from them)
        self._indexes: dict[tuple[str, str], tuple[bytes, Index]] = {}

    def index(self, path: str | os.PathLike[str], *, display: str | None = None) -> Index:
        """The index at ``path`` as it is now (findings for what is wrong with it; raises
        :class:`~ckptctl.errors.CkptctlError` only when it cannot be read at all)."""
        p = os.fspath(path)
        idx = Index(display or p)
        raw = read_index_bytes(p, idx)
        if raw is None:
            return idx
        key = (p, idx.path)
        kept = self._indexes.get(key)
        if kept is not None and kept[0] == raw:
            return kept[1].copy()
        parse_index(idx, raw, fast=self.fast)
        self._indexes[key] = (raw, idx)
        return idx.copy()

    def header(self, path: str | os.PathLike[str], *, display: str | None = None) -> Header:
        """The safetensors header of ``path``, parsed now (:func:`read_header`)."""
        return read_header(path, display=display, fast=self.fast)
