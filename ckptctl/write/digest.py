"""The sha256 of a shard computed while it is written (``--manifest``), so that the manifest
never reads the checkpoint back.

The writer produces a shard's bytes in file order: the header, then each run or tensor at its
planned offset (the layout is contiguous). :class:`ShardDigest` follows that order. Bytes that
pass through Python (the header, a streamed or converted tensor) are hashed from memory as they
are written. Bytes the kernel copies or the filesystem clones never enter Python: once their
range is final they are read back from the shard itself, from the page cache the copy has just
filled. The shard's own bytes, never the source range: the digest is of what was written, even
if the source changed meanwhile. Whatever breaks the order (a gap, a rewrite) is not guessed
around: :meth:`ShardDigest.finish` then returns None and the manifest hashes the whole file from
disk as before.

When the read-back happens is the fast path (``early``, the default): as soon as
:data:`EARLY_BYTES` of final bytes wait, a thread of the digest's own reads them back right behind
the writer, while the rest of the shard is copied, and ends once it has caught up (a later range
starts another); :meth:`~ShardDigest.finish` (the writer calls it on its background thread,
beside the fsync) reads only what is left. With ``early=False`` (the reference) everything the
kernel wrote is read back at :meth:`~ShardDigest.finish`, or before a streamed piece that follows
it. Both give the same digest.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

from ckptctl.threads import check

READ_CHUNK = 4 * 1024 * 1024
EARLY_CHUNK = 1024 * 1024  # the early reader's piece: read back and hashed while it is in cache
EARLY_BYTES = 16 * 1024 * 1024  # final bytes waiting before the early reader starts (small shards never start one)


class ShardDigest:
    """The running sha256 of the file open at ``fd``, fed in file order. Holds its own duplicate
    of ``fd`` (so the writer may close and fsync its own meanwhile) until :meth:`finish` or
    :meth:`close`. ``early``: see the module; ``early_bytes``: the final bytes waiting that start
    the early reader; ``gate``: a semaphore the writer shares between its shards' digests, so that
    at most that many early readers run at once (a digest that cannot take it leaves its bytes to
    :meth:`finish`)."""

    def __init__(self, fd: int, *, early: bool = True, early_bytes: int = EARLY_BYTES,
                 gate: threading.Semaphore | None = None) -> None:
        self.fd = os.dup(fd)
        self.early, self.early_bytes, self.gate = early, early_bytes, gate
        self._h = hashlib.sha256()
        self._hashed = 0  # bytes [0, _hashed) are in the digest
        self._final = 0  # bytes [_hashed, _final) are final in the file, still to be read from it
        self._broken = False
        self._cv = threading.Condition()
        self._reader: threading.Thread | None = None  # the early reader, while it runs
        self._closing = False

    def written(self, pos: int, data: Any) -> None:
        """``data`` is what the writer puts at ``pos`` (and nothing rewrites it later). Hashed
        from memory when it is the next byte of the file; otherwise it is read back later."""
        with self._cv:
            if pos != self._final or self._broken:
                return  # not next (a kernel copy stopped before it): its range is read back from the file
            if self._reader is not None:
                return  # the early reader is behind: this range is read back once it is final
        view = memoryview(data).cast("B")
        self._read_final()
        self._h.update(view)
        with self._cv:
            self._hashed = self._final = pos + len(view)

    def final(self, pos: int, nbytes: int) -> None:
        """Bytes ``[pos, pos + nbytes)`` are final in the file (a run or tensor is done)."""
        with self._cv:
            if pos > self._final:
                self._broken = True  # a gap: the writer did not go in file order
            self._final = max(self._final, pos + nbytes)
            self._maybe_follow()

    def progress(self, pos: int, nbytes: int) -> None:
        """Bytes ``[pos, pos + nbytes)`` are final (a step of a kernel copy). Unlike :meth:`final`
        a range that does not join the final bytes is not a gap, only too early to count (the
        pieces of one tensor may be copied in any order): :meth:`final` of the whole run or tensor
        follows and decides."""
        with self._cv:
            if pos <= self._final < pos + nbytes:
                self._final = pos + nbytes
                self._maybe_follow()

    def _maybe_follow(self) -> None:
        """Start the early reader when enough final bytes wait (under ``_cv``)."""
        if (self.early and self._reader is None and not self._broken and not self._closing
                and self._final - self._hashed >= self.early_bytes
                and (self.gate is None or self.gate.acquire(blocking=False))):
            self._reader = threading.Thread(target=self._follow, name="ckptctl-digest", daemon=True)
            self._reader.start()

    def finish(self, size: int, stop: threading.Event | None = None) -> str | None:
        """The file's sha256 once its ``size`` bytes are final (reading back what the kernel
        wrote), or None when the writes did not cover the file in order. Closes the digest's
        descriptor. With ``stop``, raises :class:`~ckptctl.threads.Stopped` between chunks once
        it is set (the writer gave up)."""
        try:
            with self._cv:
                while self._reader is not None:  # the early reader finishes its range first
                    check(stop)
                    self._cv.wait(0.1)
            if not self._broken and self._final == size:
                self._read_final(stop)
        finally:
            self.close()
        return None if self._broken or self._hashed != size else self._h.hexdigest()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _follow(self) -> None:
        """The early reader: hash the final bytes in order until it has caught up with the writer."""
        view = memoryview(bytearray(EARLY_CHUNK))
        while True:
            with self._cv:
                pos, end = self._hashed, self._final
                if pos >= end or self._closing or self._broken:
                    self._reader = None
                    if self.gate is not None:
                        self.gate.release()
                    self._cv.notify_all()
                    return
            try:
                n = os.preadv(self.fd, [view[:min(len(view), end - pos)]], pos)
            except OSError:
                n = 0
            if n > 0:
                self._h.update(view[:n])  # only this thread feeds the digest while it runs
            with self._cv:
                if n <= 0:  # shorter than written (or unreadable): never a digest of what is not there
                    self._broken = True
                else:
                    self._hashed = pos + n

    def _read_final(self, stop: threading.Event | None = None) -> None:
        pos, end = self._hashed, self._final
        if pos >= end:
            return
        buf = bytearray(min(READ_CHUNK, end - pos))
        view = memoryview(buf)
        while pos < end:
            check(stop)
            n = os.preadv(self.fd, [view[:min(len(buf), end - pos)]], pos)
            if n <= 0:  # shorter than written: never a digest of what is not there
                self._broken = True
                return
            self._h.update(view[:n])
            pos += n
        self._hashed = end
