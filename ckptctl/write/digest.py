"""The sha256 of a shard computed while it is written (``--manifest``), so that the manifest
never reads the checkpoint back.

The writer produces a shard's bytes in file order: the header, then each run or tensor at its
planned offset (the layout is contiguous). :class:`ShardDigest` follows that order. Bytes that
pass through Python (the header, a streamed or converted tensor) are hashed from memory as they
are written. Bytes the kernel copies or the filesystem clones never enter Python: once their
range is final they are read back from the shard itself, from the page cache the copy has just
filled, at :meth:`ShardDigest.finish` (the writer calls it on its background thread, beside the
fsync, while the next shard is written). The shard's own bytes, never the source range: the
digest is of what was written, even if the source changed meanwhile. Whatever breaks the order
(a gap, a rewrite) is not guessed around: :meth:`finish` then returns None and the manifest
hashes the whole file from disk as before.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

from ckptctl.threads import check

READ_CHUNK = 4 * 1024 * 1024


class ShardDigest:
    """The running sha256 of the file open at ``fd``, fed in file order. Holds its own duplicate
    of ``fd`` (so the writer may close and fsync its own meanwhile) until :meth:`finish` or
    :meth:`close`."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)
        self._h = hashlib.sha256()
        self._hashed = 0  # bytes [0, _hashed) are in the digest
        self._final = 0  # bytes [_hashed, _final) are final in the file, still to be read from it
        self._broken = False

    def written(self, pos: int, data: Any) -> None:
        """``data`` is what the writer puts at ``pos`` (and nothing rewrites it later). Hashed
        from memory when it is the next byte of the file; otherwise it is read back later."""
        if pos != self._final or self._broken:
            return  # not next (a kernel copy stopped before it): its range is read back from the file
        view = memoryview(data).cast("B")
        self._read_final()
        self._h.update(view)
        self._hashed = self._final = pos + len(view)

    def final(self, pos: int, nbytes: int) -> None:
        """Bytes ``[pos, pos + nbytes)`` are final in the file (a run or tensor is done)."""
        if pos > self._final:
            self._broken = True  # a gap: the writer did not go in file order
        self._final = max(self._final, pos + nbytes)

    def finish(self, size: int, stop: threading.Event | None = None) -> str | None:
        """The file's sha256 once its ``size`` bytes are final (reading back what the kernel
        wrote), or None when the writes did not cover the file in order. Closes the digest's
        descriptor. With ``stop``, raises :class:`~ckptctl.threads.Stopped` between chunks once
        it is set (the writer gave up)."""
        try:
            if not self._broken and self._final == size:
                self._read_final(stop)
        finally:
            self.close()
        return None if self._broken or self._hashed != size else self._h.hexdigest()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

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
