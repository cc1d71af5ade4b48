"""A large index read by a worker process beside the shard headers: a scan split between two cores.

A checkpoint of 90k tensors holds about as many bytes of index (10 MB of JSON) as of headers.
:class:`Split` forks a worker (:mod:`ckptctl.worker`) that parses the index, with each shard's
names joined (``Index.joins``), and then takes shard headers from the back of the list, while
this process takes them from the front; each side claims a shard in shared memory before it
parses it (:class:`_Board`), so both finish together on any machine, with no fixed share. The
headers are kept for the reads that follow (:mod:`ckptctl.format.read_ahead`), each handed out
once to a read of the same file, by its fstat identity. Where the two sides meet, a shard may be
parsed twice; one that neither parsed (the worker died) is parsed when it is read: the split
decides only how fast the scan is, never what it finds.

``layout.scan`` starts the split of the index it reads (:func:`take`) inside a read-ahead scope
of the directory. On this 2-core machine the two processes slow each other (a header parse takes
20-50% longer while the other core parses JSON), and a header handed over costs about half what
parsing it does (pickled, then unpickled): the worker's share stays small on its own.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from ckptctl.format import read_ahead
from ckptctl.format.header import Header, read_header_ahead
from ckptctl.format.index import MAX_INDEX_SIZE, Index, read_for_worker
from ckptctl.format.read_ahead import Identity, NamesWork
from ckptctl.worker import Job, WorkerFailed, start

# An index this large (about 11k tensors) is parsed by a worker beside the shard headers; below
# it the fork costs more than it saves.
READ_AHEAD_INDEX_BYTES = 1 << 20
# the worker's result: each shard's names (less than the index) and its headers (about as many
# bytes as the index)
_CAPACITY = 2 * MAX_INDEX_SIZE + (16 << 20)

Kept = tuple[str, str, Identity, Header]


class _Board:
    """Two shard positions in memory both processes share, as 4-byte slots: ``slots[FRONT]``, the
    next one this process takes (counting up), and ``slots[BACK]``, the last one the worker took
    (counting down)."""

    FRONT, BACK = 0, 1

    def __init__(self, n: int) -> None:
        self._m = mmap.mmap(-1, 8)
        self.slots = memoryview(self._m).cast("I")
        self.slots[self.BACK] = n

    def close(self) -> None:
        self.slots.release()  # the mapping closes only once no view of it is left
        self._m.close()


def _worker(index: str, paths: list[str], board: _Board,
            work: NamesWork | None) -> tuple[Index, Any, list[Kept]]:
    """The worker's side: the index (and the work on its names), then headers from the back
    until it meets the front."""
    doc = read_for_worker(index, index)
    facts = None
    if work is not None and doc.joins is not None:
        try:
            facts = work(doc.joins)
        except Exception:  # noqa: BLE001 - the parent does the same work itself, and meets the error there
            facts = None
    got: list[Kept] = []
    slots, front, back = board.slots, board.FRONT, board.BACK
    while (k := slots[back] - 1) >= slots[front]:  # not yet taken from the front: take it
        slots[back] = k
        read_header_ahead(paths[k], lambda *kept: got.append(kept))
    return doc, facts, got


class Split:
    """One index and its shards, scanned by a worker and this process together."""

    def __init__(self, index: str, paths: list[str], job: Job, board: _Board, work: NamesWork | None) -> None:
        self.index, self.paths, self.job, self.board, self.work = index, paths, job, board, work

    @classmethod
    def start(cls, root: Path, index: str, shards: list[str], work: NamesWork | None = None) -> "Split | None":
        """A split of ``root/index`` and the headers of ``shards`` (names in ``root``), or None
        where no worker runs (small index, no second CPU, threads, ``CKPTCTL_WORKERS=0``);
        ``work``: what the worker draws from the index's names (:data:`read_ahead.NamesWork`)."""
        path = str(root / index)
        try:
            if not shards or os.stat(path).st_size < READ_AHEAD_INDEX_BYTES:
                return None
        except OSError:
            return None
        paths = [str(root / n) for n in shards]
        board = _Board(len(paths))
        job = start(_worker, path, paths, board, work, capacity=_CAPACITY)
        if job is None:
            board.close()
            return None
        return cls(path, paths, job, board, work)

    def finish(self) -> Index | None:
        """This process's side (headers from the front, kept for their reads), then the worker's
        index and headers; None when the worker failed (the caller reads the index itself)."""
        board = self.board
        slots = board.slots
        try:
            with self.job:
                p = 0
                while p < len(self.paths):
                    slots[board.FRONT] = p + 1  # taken: the worker stops before it
                    if p >= slots[board.BACK]:  # the worker took it first
                        break
                    read_header_ahead(self.paths[p])
                    p += 1
                try:
                    doc, facts, theirs = self.job.result()
                except WorkerFailed:
                    return None
        finally:
            board.close()
        mine = set(self.paths[:p])
        for kept in theirs:
            if kept[0] not in mine:  # where both parsed one, this process's copy is kept
                read_ahead.keep(*kept)
        if facts is not None:
            doc.facts = (self.work, facts)
        return doc.copy()


# The last index a split read: a command scans its source again (export: the root test, then
# the source) and the file is the same one (device, inode, size, mtime and ctime in ns), so is
# its reading, and the headers the first split kept are still there for their reads.
_last: Index | None = None


def take(root: Path, index: str, shards: list[str]) -> Index | None:
    """The index ``root/index`` read by a split with the headers of ``shards``; None when no
    split runs (the caller reads the index itself). Only inside a read-ahead scope of ``root``:
    the headers are kept for that command's reads."""
    global _last
    if not read_ahead.wanted(root):
        return None
    path = str(root / index)
    last = _last
    if last is not None and last._file is not None and last._file[0] == path:
        try:
            if read_ahead.identity(os.stat(path)) == last._file[1]:
                return last.copy()
        except OSError:
            pass
    split = Split.start(root, index, shards, read_ahead.names_work(root))
    doc = split.finish() if split is not None else None
    if doc is not None:
        _last = doc._source  # the reading itself (finish hands out a copy of it)
    return doc
