"""One version of a directory that writers replace by rename: what a reader reads is one version.

ckptctl publishes a checkpoint by renaming a complete directory onto the published path
(``RENAME_EXCHANGE``, or the two renames of the fallback), then removes the previous version. A
reader that goes path by path can straddle a publish: the listing of the old version and the
index of the new one (a checkpoint that was complete at every instant reported broken), or a file
of the old version removed under it (``io.error``).

:func:`one_version` runs a command's whole read of a directory (verify, inspect, resave's
analysis) and proves it read one version: the directory is opened once before the read
(:class:`Held`) and, after the read (or when it failed), the path must still name that very
directory. The descriptor held open keeps the directory's inode allocated, so its number cannot
be reused by a later version: a path that names the same inode after the read named it during
the read (a publish always renames a *new* directory onto the path), and every path-based read
went to that one version. When the path names another directory (a publish completed while it
was read) or nothing (between the two renames of the fallback), the read is thrown away and made
again on the version now published, at most :data:`ATTEMPTS` times.

The one case this does not see is the same directory moved away and back (a two-rename publish
rolled back by recovery after its writer died); a read in that window fails as it would without
a writer (the files are not there), and says so.

The cost is one ``open``, ``fstat`` and ``stat`` per read of a directory (about 10 us).
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

from ckptctl.errors import OperationalError

T = TypeVar("T")

ATTEMPTS = 8  # reads of a directory replaced while it is read, before giving up (exit 3)
_BACKOFF = 0.02  # seconds, times the attempt: the fallback's window between its two renames


class Held:
    """A directory opened once (``O_DIRECTORY``; the path's links followed, as the reader follows
    them), with the identity (device, inode) of what it opened."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Held | None":
        """The directory at ``path`` held open, or None when ``path`` is not a directory now
        (missing, a file, unreadable: the reader then reports what it finds)."""
        p = os.fspath(path)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            return cls(p, fd)
        except OSError:
            os.close(fd)
            return None

    def current(self) -> bool:
        """Whether the path still names the directory held (False: replaced or gone)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def one_version(path: str | os.PathLike[str], read: Callable[[int], T], *, held: Held | None = None,
                attempts: int = ATTEMPTS) -> T:
    """``read(attempt)`` of the directory at ``path``, proven to have read one version (see the
    module's docstring); made again while the path was replaced during it. ``held``: the
    directory already held by the caller since before its first read (attempt 0 may then reuse
    what the caller read under it); it is closed here. A path that is not a directory is read
    once, as it is. Raises :class:`~ckptctl.errors.OperationalError` (exit 3) when every attempt
    was superseded by another publish."""
    for attempt in range(attempts):
        if held is None:
            held = Held.open(path)
            if held is None:
                if attempt == 0 or attempt == attempts - 1:
                    return read(attempt)  # not a directory: read once, as it is
                time.sleep(_BACKOFF * attempt)  # gone: the window between the fallback's two renames
                continue
        try:
            result = read(attempt)
        except Exception:  # whatever a straddled read raised: decided by the version, re-raised if it held
            if held.current():
                raise
        else:
            if held.current():
                return result
        finally:
            held.close()
        held = None
    raise OperationalError(f"{os.fspath(path)} was replaced {attempts} times while it was read: a writer keeps "
                           "publishing to it",
                           "run the command again once the writer is done")
