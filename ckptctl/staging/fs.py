"""Filesystem primitives that never follow a link: the one removal (NFS-aware), fsync, small
files, walking down from a root by directory file descriptors, and the uncached look at a
directory that decides what a rename really did.

Network and FUSE filesystems cache names: after a rename whose reply was lost (EIO from a timed
out NFS request) the kernel still believes the old name exists, and ``lstat`` answers from that
cache. :func:`listing` reads the directory itself (``getdents``), which NFS revalidates on open
and FUSE asks the filesystem for every time; every decision about a half-done publish is made on
it (:func:`moved`, ``state.phase``).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Callable

from ckptctl.staging.lock import DIR_FLAGS
from ckptctl.staging.mounts import MountInside, MountProbe

_NFS_RETRIES = (0.2, 0.4, 0.8)
# what a file unlinked while still open becomes: NFS clients' silly rename, libfuse's hiding
SILLY_PREFIXES = (".nfs", ".fuse_hidden")


class Deferred(OSError):
    """Files still open elsewhere were silly-renamed (``.nfsXXXX``, ``.fuse_hiddenXXXX``) and
    cannot go yet: the next run finishes the job."""


def fsync_path(path: Path, *, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small(path: Path, data: bytes, *, fsync: bool) -> None:
    """Create ``path`` (never an existing one) holding ``data``; fsynced unless ``fsync`` is False."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def listing(path: Path) -> dict[str, os.DirEntry[str]]:
    """The entries of the directory ``path`` as the filesystem has them now (read from the
    directory, not from the kernel's name cache). Raises OSError when it cannot be read."""
    with os.scandir(path) as it:
        return {e.name: e for e in it}


def moved(src: Path, dst: Path) -> bool:
    """Did ``rename(src, dst)`` happen? ``src`` gone and ``dst`` present, by :func:`listing`.
    False when either directory cannot be read."""
    try:
        return src.name not in listing(src.parent) and dst.name in listing(dst.parent)
    except OSError:
        return False


def rename(src: Path, dst: Path) -> None:
    """``os.rename``, except that an error is first checked against the directories themselves:
    a rename that was done although its reply was lost (a network filesystem's EIO) returns
    normally. Every other error is raised."""
    try:
        os.rename(src, dst)
    except OSError:
        if not moved(src, dst):
            raise


def open_beneath(root: Path, rel: tuple[str, ...]) -> int:
    """An fd of ``root/rel...``, reached from ``root`` one component at a time with O_NOFOLLOW:
    a component swapped for a symlink makes this fail instead of leaving the root."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rel:
            nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_at(parent_fd: int, name: str, *, where: str, keep_last: tuple[str, ...] = (),
              before_last: Callable[[], None] | None = None) -> int:
    """Remove ``name`` under ``parent_fd`` (a file, a link as a link, or a tree) without following
    links and without crossing a mount point; returns the bytes actually freed (a regular file's
    last link).

    ``keep_last`` names inside the directory are removed after everything else, in that order;
    ``before_last`` is called just before the last of them goes (the staging lock is closed there:
    a file unlinked while open is silly-renamed on NFS and hidden by libfuse, and would keep the
    directory from going). ENOENT anywhere is someone else having removed it first (an
    overlapping gc run): fine. Silly-renamed files still open elsewhere are retried, then
    :class:`Deferred` is raised. An entry on another mount than the directory holding it (a
    volume, a tmpfs, a bind mount of the same filesystem, a file bind-mounted over a file) is
    never descended into nor unlinked: :class:`~ckptctl.staging.mounts.MountInside` is raised,
    naming it, and what was removed before stays removed. Errors carry ``where`` (the full path)
    as their filename."""
    probe = MountProbe()
    return _remove_checked(parent_fd, name, where, keep_last, before_last, probe, probe.home(parent_fd))


def _remove_checked(parent_fd: int, name: str, where: str, keep_last: tuple[str, ...],
                    before_last: Callable[[], None] | None, probe: MountProbe, home: tuple[int, int | None]) -> int:
    try:
        return _remove_at(parent_fd, name, where, keep_last, before_last, probe, home)
    except OSError as exc:
        if exc.filename == name:
            exc.filename = where
        raise


def remove_tree(path: Path) -> int:
    """:func:`remove_at` by path (the parent is opened as given; ``path`` itself is never followed)."""
    pfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return remove_at(pfd, path.name, where=str(path))
    finally:
        os.close(pfd)


def _remove_entries(dfd: int, where: str, skip: tuple[str, ...], probe: MountProbe,
                    home: tuple[int, int | None]) -> int:
    """Remove everything inside the directory ``dfd`` (``where``, for messages; ``home``: its
    device and mount) except ``skip``."""
    freed = 0
    with os.scandir(dfd) as it:
        names = [e.name for e in it]
    for name in names:
        if name in skip:
            continue
        try:
            freed += _remove_checked(dfd, name, f"{where}/{name}", (), None, probe, home)
        except MountInside:
            raise
        except OSError as exc:
            # NFS refuses to unlink a silly-renamed file that is still open: retried by the caller
            if not (name.startswith(SILLY_PREFIXES) and exc.errno in (errno.EBUSY, errno.ENOTEMPTY)):
                raise
    return freed


def _remove_at(parent_fd: int, name: str, where: str, keep_last: tuple[str, ...],
               before_last: Callable[[], None] | None, probe: MountProbe, home: tuple[int, int | None]) -> int:
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if st.st_dev != home[0]:
        raise MountInside(where)  # another filesystem: never unlinked, never descended into
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            # the kernel refuses to unlink a mount point (a file bind-mounted over a file): say so
            if exc.errno == errno.EBUSY and probe.is_other(parent_fd, name, home):
                raise MountInside(where) from None
            raise
        # the last link of a regular file frees its blocks
        return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0
    try:
        dfd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return 0
    freed = 0
    try:
        inner = probe.check_dir(dfd, home, where)  # what was opened (a bind mount has the same st_dev)
        fst = os.fstat(dfd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise OSError(errno.ESTALE, "changed while being removed", name)
        for attempt in range(len(_NFS_RETRIES) + 1):
            freed += _remove_entries(dfd, where, keep_last, probe, inner)
            for i, last in enumerate(keep_last):
                if before_last is not None and i == len(keep_last) - 1:
                    before_last()
                freed += _remove_checked(dfd, last, f"{where}/{last}", (), None, probe, inner)
            try:
                os.rmdir(name, dir_fd=parent_fd)
                return freed
            except FileNotFoundError:
                return freed
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EBUSY):
                    raise
                # open files were silly-renamed (.nfsXXXX, .fuse_hiddenXXXX); they go when closed elsewhere
                if attempt < len(_NFS_RETRIES):
                    time.sleep(_NFS_RETRIES[attempt])
                    continue
                with os.scandir(dfd) as it:
                    left = [e.name for e in it]
                if left and all(n.startswith(SILLY_PREFIXES) for n in left):
                    raise Deferred(errno.EBUSY, f"files still open elsewhere ({', '.join(sorted(left)[:3])}); "
                                   "the next run finishes the job", where) from None
                raise
    finally:
        os.close(dfd)
    return freed
