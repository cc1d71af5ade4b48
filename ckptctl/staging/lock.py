"""The one flock of a staging directory: acquire, probe, release.

The writer holds ``<staging>/lock`` (``flock(LOCK_EX)``) for its whole life; gc-tmp and a writer
recovering a dead writer's directory take it before they touch anything; a liveness probe takes it
for a moment and lets go. Every open is ``O_NOFOLLOW | O_NONBLOCK`` (a link or a FIFO in the lock's
place is an error, never followed, never waited on) and the lock must be a regular file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

LOCK = "lock"

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# flock says "held by someone else" with EWOULDBLOCK; NFS (fcntl-lock emulation) also with EACCES
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
# an exclusive lock on NFS needs a writable descriptor; elsewhere a read-only one does
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


class NotALock(OSError):
    """The lock's name holds a symbolic link or something other than a regular file. No writer's
    lock is ever one (a writer creates it as a regular file and keeps it), so nobody holds it."""


class StagingLock:
    """A held flock on ``<staging>/lock``. ``release()`` (or leaving a ``with`` block) drops it."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None

    def __enter__(self) -> StagingLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open_lock(dir_fd: int, where: Path, *, create: bool) -> int:
    rw = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        try:
            fd = os.open(LOCK, rw | _LOCK_FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
            fd = os.open(LOCK, os.O_RDONLY | _LOCK_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotALock(errno.ELOOP, "the lock is a symbolic link", str(where)) from None
        if exc.errno == errno.EISDIR:
            raise NotALock(errno.EISDIR, "the lock is a directory", str(where)) from None
        if exc.filename == LOCK:
            exc.filename = str(where)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotALock(errno.EINVAL, "the lock is not a regular file", str(where))
    return fd


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _HELD:
            return False
        raise
    return True


def acquire(staging: Path, *, parent_fd: int | None = None, create: bool = True,
            patience: float = 0.0) -> StagingLock | None:
    """Take the staging directory's lock without blocking; None when another process holds it.

    With ``patience`` seconds, retry briefly (a liveness probe holds it for microseconds). The
    directory is opened ``O_NOFOLLOW`` (by name relative to ``parent_fd`` when given). After
    locking, the lock file must still be the directory's: one that a concurrent removal unlinked
    meanwhile raises FileNotFoundError, as does a directory or (without ``create``) a lock that is
    gone."""
    dfd = os.open(staging.name if parent_fd is not None else staging, DIR_FLAGS, dir_fd=parent_fd)
    try:
        where = staging / LOCK
        fd = _open_lock(dfd, where, create=create)
        try:
            deadline = time.monotonic() + patience
            while not _try_flock(fd):
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.005)
            a, b = os.fstat(fd), os.stat(LOCK, dir_fd=dfd, follow_symlinks=False)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise FileNotFoundError(errno.ENOENT, "lock file replaced", str(where))
        except BaseException:
            os.close(fd)
            raise
        return StagingLock(fd)
    finally:
        os.close(dfd)


def probe(staging: Path) -> bool:
    """True when some process holds the staging directory's lock. Never blocks, never creates the
    lock, never follows a link; a missing lock (or directory) is a free one, and so is a link or
    a FIFO in its place (:class:`NotALock`)."""
    try:
        lock = acquire(staging, create=False)
    except (FileNotFoundError, NotALock):
        return False
    if lock is None:
        return True
    lock.release()
    return False
