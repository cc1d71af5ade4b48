"""What one command reads of a checkpoint's metadata, decoded once and kept for that command.

A command creates one :class:`MetadataReading` and passes it down (``layout.scan(path,
reading=...)``, the export job, resave's analysis and the verify it runs, verify's context). It is
the only place where metadata outlives one call, so what a read returns never depends on what
else the process did. Every read goes to the file as it is now; only the decoding is kept:

- an **index** is read again (bounded) at every read, and parsed only when its bytes are bytes
  this reading parsed before (compared whole: never judged by a size or a time stamp). Each read
  gets its own :meth:`Index.copy`.
- a **header** is read again (its length field, then the header's bytes) at every read, and
  decoded only when the file's size and those bytes are not a pair this reading decoded before:
  a shard rewritten in place is seen as it is now, and the same bytes under another name (the
  hard-linked shards of a repair's staged version, which its verify reads) are decoded once.
  Each read gets its own :meth:`Header.copy`.

A reading made with ``names_work`` (verify's: :func:`ckptctl.verify.model.name_facts`) runs it on
the names of every index of :data:`NAMES_WORK_FROM` bytes or more it parses, in a worker
(:mod:`ckptctl.worker`) forked just before this process parses the index: the child parses the
same bytes with the same reader and works on their names, while this process parses them and
goes on to decode the shard headers (forked before the parse, the child shares no page of the
parsed index: this process writes none of the pages it shares with the child, each a fault and a
copy, as it builds it). The caller takes the result with
:meth:`~ckptctl.format.index.Index.name_facts` and uses it only for the very names of that index.
``workers`` (default: the ``names-worker`` fast path's switch) turns the worker off; without one
the caller works the same facts out itself when it needs them.

What was decoded is known by its bytes, looked up by their length (and the file's size) and
compared whole: a header of up to :data:`KEEP_BYTES` and an index (bounded at 10 MiB) are kept
as bytes (a shard's header is a few KB to a few hundred: a copy costs less than any digest of
it, and nothing is hashed where nothing is read twice); a larger header by its SHA-256 (a
hundredth of decoding it, and no second copy of a 90 MB header). A reading made under one name
is handed to another only when it has no findings: a finding's message names the path it was
found at.

``fast`` switches every metadata fast path at once: msgspec's typed readers of the index
(:func:`ckptctl.format.index.parse_index`) and of the headers
(:func:`ckptctl.format.header.read_header`). With ``fast=False`` only the reference readers run.
The typed readers earn their import (msgspec's, about 7 ms) only on enough text: a reading hands
them the index or header that brings what it has read to :data:`TYPED_FROM` bytes, and every one
after it (:meth:`MetadataReading.typed`); before that the reference readers (``json``, which
reads a 64 KiB index in well under a millisecond; the strict header reader, 64 KiB in about
2.5 ms) read them. Each typed reader reads what its reference reads, so which one did is never seen.
Left unset, it is on unless the environment says ``CKPTCTL_FAST_METADATA=0`` (how a command line,
and the suite's runs of the commands with the reference readers, turn it off); the suite runs
the commands both ways and compares their documents byte for byte.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ckptctl.fastpaths import enabled
from ckptctl.format.header import Header, checked, decode_header, read_header_bytes
from ckptctl.format.index import Index, parse_index, read_index_bytes


# An index of this many bytes or more (about 10,000 names) has its names work (``names_work``)
# run by a worker: below it, the fork and the result's way back cost more than the work (about
# half a microsecond a name).
NAMES_WORK_FROM = 1 << 20
# the worker's result: address space reserved, touched only as far as its pickle fills it
NAMES_WORK_CAPACITY = 1 << 26
KEEP_BYTES = 1 << 20  # headers up to this size are kept and compared whole; larger ones by their digest
TYPED_FROM = 1 << 16  # index and header bytes a reading reads before the typed readers take over (see the module)


class MetadataReading:
    """One command's reading of checkpoint metadata (see the module's docstring)."""

    def __init__(self, *, fast: bool | None = None, names_work: Callable[[Any], Any] | None = None,
                 workers: bool | None = None) -> None:
        self.fast = enabled("metadata") if fast is None else fast
        # what the command works out from an index's names (verify: its config rules' facts), and
        # whether a forked worker may do it beside the header decoding (see the module)
        self.names_work = names_work
        self.workers = enabled("names-worker") if workers is None else workers
        # by length: (the bytes, the Index parsed from them)
        self._indexes: dict[int, list[tuple[bytes, Index]]] = {}
        # by (file size, header length): (the header's bytes, or their SHA-256 above KEEP_BYTES; the Header)
        self._headers: dict[tuple[int, int], list[tuple[bytes, Header]]] = {}
        self._decoded = 0  # index and header bytes this reading was asked to parse or decode

    def index(self, path: str | os.PathLike[str], *, display: str | None = None) -> Index:
        """The index at ``path`` as it is now (findings for what is wrong with it; raises
        :class:`~ckptctl.errors.CkptctlError` only when it cannot be read at all)."""
        p = os.fspath(path)
        idx = Index(display or p)
        raw = read_index_bytes(p, idx)
        if raw is None:
            return idx
        kept = self._indexes.setdefault(len(raw), [])
        for seen, parsed in kept:
            if seen == raw and (parsed.path == idx.path or not parsed.findings):
                return parsed.copy(idx.path)
        fast = self.typed(len(raw))
        if self.names_work is not None and self.workers and len(raw) >= NAMES_WORK_FROM:
            from ckptctl import worker

            idx.names_job = worker.start(_names_work_on, self.names_work, raw, fast, capacity=NAMES_WORK_CAPACITY)
        parse_index(idx, raw, fast=fast)
        kept.append((raw, idx))
        return idx.copy()

    def header(self, path: str | os.PathLike[str], *, display: str | None = None, keep: bool = True) -> Header:
        """The safetensors header of ``path`` as it is now (:func:`~ckptctl.format.header.read_header`).
        ``keep=False``: for a reader that will not ask for this header again (inspect, an export's
        source): a decoding this reading kept is still used, but this one is not kept (no copy of
        its bytes, no digest)."""
        hdr, raw = read_header_bytes(path, display=display)
        if raw is None:  # unreadable before any decoding: nothing to keep
            return hdr
        key = (hdr.file_size, len(raw))
        kept = self._headers.get(key)
        if kept or keep:
            known = bytes(raw) if len(raw) <= KEEP_BYTES else _digest(raw)
            for seen, decoded in kept or ():
                if seen == known and (decoded.path == hdr.path or not decoded.findings):
                    return decoded.copy(hdr.path)
        decode_header(hdr, raw, fast=self.typed(len(raw)))
        if not keep:
            return hdr
        self._headers.setdefault(key, []).append((known, hdr))
        return hdr.copy()

    def load_header(self, path: str | os.PathLike[str], *, display: str | None = None, keep: bool = True) -> Header:
        """:meth:`header`, raising :class:`~ckptctl.errors.InputError` for an invalid one (as
        :func:`~ckptctl.format.header.load_header`)."""
        return checked(self.header(path, display=display, keep=keep))

    def typed(self, size: int) -> bool:
        """Whether the typed reader reads the next index or header, of ``size`` bytes: with ``fast``
        on, once what this reading has parsed and decoded, that one included, reaches :data:`TYPED_FROM`."""
        self._decoded += size
        return self.fast and self._decoded >= TYPED_FROM


def _names_work_on(work: Callable[[Any], Any], raw: bytes, fast: bool) -> Any:
    """The worker's call: ``work`` on the names of the index ``raw`` parsed as this reading parses
    it (the same bytes, the same reader: the same names); None for an index with an error."""
    idx = Index("")
    parse_index(idx, raw, fast=fast)
    return work(idx.shared_map) if idx.ok else None


def _digest(raw: bytearray) -> bytes:
    import hashlib  # only for a header over KEEP_BYTES (hashlib's import is a cost every command would pay)

    return hashlib.sha256(raw).digest()
