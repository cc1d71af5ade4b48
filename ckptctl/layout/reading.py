"""What one command reads of a checkpoint's metadata, decoded once and kept for that command.

A command creates one :class:`MetadataReading` and passes it down (``layout.scan(path,
reading=...)``, the export job, resave's analysis and the verify it runs, verify's context). It is
the only place where metadata outlives one call, so what a read returns never depends on what
else the process did. Every read goes to the file as it is now; only the decoding is kept:

- an **index** is read again (bounded) at every read, and parsed only when its bytes are bytes
  this reading parsed before (compared whole, with the file piece by piece rather than read into
  a second copy: never judged by a size or a time stamp). Each read gets its own :meth:`Index.copy`.
- a **header** is read again (its length field, then the header's bytes) at every read, and
  decoded only when the file's size and those bytes are not a pair this reading decoded before:
  a shard rewritten in place is seen as it is now, and the same bytes under another name (the
  hard-linked shards of a repair's staged version, which its verify reads) are decoded once.
  Each read gets its own :meth:`Header.copy`.

An index of :data:`WORKER_FROM` bytes or more is parsed by a worker (:mod:`ckptctl.worker`)
where one can run: a child forked with its bytes parses them with the same reader (told the
names of the folder's safetensors files, which the index's values probably are: each such value
is then one shared string, :func:`ckptctl.format.index_fast.load`) and hands back
its findings, metadata and shards, each shard's names sorted and joined by newlines (for a
reading made with ``agreement``, the default: inspect and an export ask no agreement), and, for a reading
made with ``names_work`` (verify's: :func:`ckptctl.verify.model.name_facts`), that work's result
on the names; meanwhile this process decodes the headers of the safetensors files in the
index's folder ahead (kept apart, each used once, and only for the very bytes it came from). The
index's map is parsed here only when someone asks for it (:meth:`~ckptctl.format.index.Index.from_worker`):
verify's and a repair's agreement checks read the joined names
(:meth:`~ckptctl.format.index.Index.agrees`), and the names work's result is used only for the
very names of that index (:meth:`~ckptctl.format.index.Index.name_facts`). ``workers``
(default: the ``index-worker`` fast path's switch) turns the worker off: the index is then parsed
here, and nothing is decoded ahead. A worker that fails leaves the parse to this process.

What was decoded is known by its bytes, looked up by their length (and the file's size) and
compared whole: a header of up to :data:`KEEP_BYTES` and an index (bounded at 10 MiB) are kept
as bytes (a shard's header is a few KB to a few hundred: the buffer it was read into, which its
decoding leaves as it is, costs nothing more, where a copy of a 163-shard checkpoint's headers
was 11 MB copied for nothing, and nothing is hashed where nothing is read twice); a larger header
by its SHA-256 (a hundredth of decoding it, and no second copy of a 90 MB header). A reading made
under one name is handed to another only when it has no findings: a finding's message names the
path it was found at.

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

from ckptctl.errors import CkptctlError
from ckptctl.fastpaths import enabled
from ckptctl.format.header import Header, checked, decode_header, read_header_bytes
from ckptctl.format.index import Index, parse_index, read_index_bytes, worker_reading


# An index of this many bytes or more (about 10,000 names) is parsed by a worker (see the module):
# below it, the fork and the result's way back cost more than the parse.
WORKER_FROM = 1 << 20
# the worker's result: address space reserved, touched only as far as its pickle fills it
WORKER_CAPACITY = 1 << 28
# headers decoded ahead while a worker parses an index: the first files of its folder, by name, as
# long as their header text stays within this many times the index's (an index of 92k names: 8.8
# MB, its 163 headers 10.6 MB); what is left is decoded when it is read, as without a worker
AHEAD_FILES = 4096
AHEAD_PER_INDEX_BYTE = 4
KEEP_BYTES = 1 << 20  # headers up to this size are kept and compared whole; larger ones by their digest
TYPED_FROM = 1 << 16  # index and header bytes a reading reads before the typed readers take over (see the module)


class MetadataReading:
    """One command's reading of checkpoint metadata (see the module's docstring)."""

    def __init__(self, *, fast: bool | None = None, names_work: Callable[[Any], Any] | None = None,
                 workers: bool | None = None, agreement: bool = True) -> None:
        self.fast = enabled("metadata") if fast is None else fast
        # what the command works out from an index's names (verify: its config rules' facts),
        # whether it asks an index's agreement with its shards (a worker then hands back each
        # shard's names for it; inspect and an export do not), and whether a large index is
        # parsed by a forked worker (see the module)
        self.names_work = names_work
        self.agreement = agreement
        self.workers = enabled("index-worker") if workers is None else workers
        # headers decoded ahead while a worker parsed an index, as _headers; each used once
        self._ahead: dict[tuple[int, int], list[tuple[bytes | bytearray, Header]]] = {}
        self._done: list[Any] = []  # workers that delivered (ckptctl.worker.Job), reaped with the reading
        # by length: (the bytes, the Index parsed from them)
        self._indexes: dict[int, list[tuple[bytes, Index]]] = {}
        # by (file size, header length): (the header's bytes, or their SHA-256 above KEEP_BYTES; the Header)
        self._headers: dict[tuple[int, int], list[tuple[bytes | bytearray, Header]]] = {}
        self._decoded = 0  # index and header bytes this reading was asked to parse or decode

    def index(self, path: str | os.PathLike[str], *, display: str | None = None) -> Index:
        """The index at ``path`` as it is now (findings for what is wrong with it; raises
        :class:`~ckptctl.errors.CkptctlError` only when it cannot be read at all)."""
        p = os.fspath(path)
        idx = Index(display or p)
        # bytes this reading parsed before are compared with the file, never read into a copy
        raw = read_index_bytes(p, idx, same_as=[seen for kept in self._indexes.values() for seen, _ in kept])
        if raw is None:
            return idx
        kept = self._indexes.setdefault(len(raw), [])
        for seen, parsed in kept:
            if seen == raw and (parsed.path == idx.path or not parsed.findings):
                return parsed.copy(idx.path)
        fast = self.typed(len(raw))
        read = self._worker_read(p, idx.path, raw, fast) if self.workers and len(raw) >= WORKER_FROM else None
        if read is not None:
            idx = Index.from_worker(idx.path, raw, fast, read[0], facts=read[1])
        else:
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
        kept, ahead = self._headers.get(key), self._ahead.get(key)
        if kept or ahead or keep:
            # compared as read (copied only to be kept, below)
            known: bytes | bytearray = raw if len(raw) <= KEEP_BYTES else _digest(raw)
            for seen, decoded in kept or ():
                if seen == known and (decoded.path == hdr.path or not decoded.findings):
                    return decoded.copy(hdr.path)
            for i, (seen, decoded) in enumerate(ahead or ()):
                if seen == known and (decoded.path == hdr.path or not decoded.findings):
                    del ahead[i]  # decoded ahead: used once, then kept as any decoding (keep)
                    if keep:
                        self._headers.setdefault(key, []).append((seen, decoded))
                    return decoded.copy(hdr.path)
        if not keep:
            decode_header(hdr, raw, fast=self.typed(len(raw)))
            return hdr
        # kept as read: the bytes themselves (not emptied by the decoding, no copy), or their digest
        decode_header(hdr, raw, fast=self.typed(len(raw)), keep=known is raw)
        self._headers.setdefault(key, []).append((known, hdr))
        return hdr.copy()

    def _worker_read(self, path: str, shown: str, raw: bytes, fast: bool) -> tuple[dict[str, Any], Any] | None:
        """The index ``raw`` parsed by a worker (:func:`~ckptctl.format.index.worker_reading`)
        while this process decodes the headers of its folder's safetensors files ahead: what it
        read, and the job whose next value is the names work's result (None without names work);
        None where no worker runs or it failed (the caller parses the index itself)."""
        from ckptctl import worker

        folder = os.path.dirname(path) or "."
        names = _safetensors_names(folder)  # the index's values are probably these (the worker's parse)
        job = worker.start(worker_reading, raw, shown, fast, self.names_work, self.agreement, tuple(names),
                           capacity=WORKER_CAPACITY)
        if job is None:
            return None
        try:
            self._decode_ahead(folder, names, AHEAD_PER_INDEX_BYTE * len(raw))
            got = job.next()
        except worker.WorkerFailed:
            return None
        except BaseException:  # Ctrl-C, SIGTERM: the child is killed and reaped before it goes on
            job.close()
            raise
        self._done.append(job)  # ending on its own: reaped with this reading, never waited for here
        if self.names_work is None:
            job.done()
        if not isinstance(got, dict):
            job.close()
            return None
        return got, job if self.names_work is not None else None

    def _decode_ahead(self, folder: str, names: list[str], budget: int) -> None:
        """Decode the headers of the safetensors files ``names`` of ``folder`` (regular files, no
        links; the first :data:`AHEAD_FILES`, while their header text stays within ``budget``
        bytes) into the decodings kept apart for one use each."""
        for name in names[:AHEAD_FILES]:
            path = os.path.join(folder, name)
            try:
                # a link or anything but a regular file is passed by, and a header over the budget
                # is not read
                hdr, raw = read_header_bytes(path, follow=False, limit=budget)
            except (OSError, CkptctlError):
                continue
            if raw is None:
                continue
            budget -= len(raw)
            key = (hdr.file_size, len(raw))
            known = raw if len(raw) <= KEEP_BYTES else _digest(raw)
            if any(seen == known for seen, _ in self._headers.get(key, ())):
                continue  # decoded already
            decode_header(hdr, raw, fast=self.typed(len(raw)), keep=known is raw)
            self._ahead.setdefault(key, []).append((known, hdr))

    def load_header(self, path: str | os.PathLike[str], *, display: str | None = None, keep: bool = True) -> Header:
        """:meth:`header`, raising :class:`~ckptctl.errors.InputError` for an invalid one (as
        :func:`~ckptctl.format.header.load_header`)."""
        return checked(self.header(path, display=display, keep=keep))

    def typed(self, size: int) -> bool:
        """Whether the typed reader reads the next index or header, of ``size`` bytes: with ``fast``
        on, once what this reading has parsed and decoded, that one included, reaches :data:`TYPED_FROM`."""
        self._decoded += size
        return self.fast and self._decoded >= TYPED_FROM


def _safetensors_names(folder: str) -> list[str]:
    """The names of ``folder`` that end in ``.safetensors`` (not hidden), sorted; none when it
    cannot be listed."""
    try:
        return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") and not n.startswith("."))
    except OSError:
        return []


def _digest(raw: bytearray) -> bytes:
    import hashlib  # only for a header over KEEP_BYTES (hashlib's import is a cost every command would pay)

    return hashlib.sha256(raw).digest()
