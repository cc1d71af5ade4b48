"""Whole files and byte ranges, below the level of a shard: clone (``FICLONE``/``FICLONERANGE``)
and the probe of whether a filesystem can, ``copy_file_range`` with its fallbacks, ``pwrite`` to
the end, and :func:`link_or_copy`, which brings a file that does not change (an unchanged shard,
a carried file) into the new version: a hard link, or with ``link=False`` an independent copy
(:func:`copy_file`: cloned where the filesystem can).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Iterable

from ckptctl.errors import InputError

# copy_file_range cannot copy between these files: stream the rest instead.
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF)
# os.link cannot link here: copy instead.
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES)
# The filesystem cannot clone (share blocks) between these files, or not this range.
_NO_CLONE = (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS, errno.EBADF,
             errno.ETXTBSY)
# linux/fs.h: _IOW(0x94, 9, int) and _IOW(0x94, 13, struct file_clone_range)
FICLONE = 0x40049409
FICLONERANGE = 0x4020940D


def clone_block(files: Iterable[str], near: Path) -> tuple[int, set[str]]:
    """The block size of the filesystem at ``near`` (its nearest existing ancestor) and those of
    ``files`` it can clone from into a new file there, found by cloning each file's first block
    into an unnamed temporary file (``O_TMPFILE``: nothing is left behind). ``(0, set())`` when
    it cannot clone at all."""
    probe = near
    while not probe.is_dir() and probe != probe.parent:
        probe = probe.parent
    try:
        tmp = os.open(probe, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in _NO_CLONE + (errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS):
            return 0, set()
        raise
    ok: set[str] = set()
    try:
        block = os.fstatvfs(tmp).f_bsize
        for path in sorted(set(files)):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                if size and clone(fd, tmp, 0, 0, min(size, block)):
                    ok.add(path)
                    os.ftruncate(tmp, 0)
            finally:
                os.close(fd)
    finally:
        os.close(tmp)
    return (block, ok) if ok else (0, ok)


def clone(src_fd: int, dst_fd: int, src_offset: int = 0, dst_offset: int = 0, length: int = 0) -> bool:
    """Share ``length`` bytes of ``src_fd`` from ``src_offset`` with ``dst_fd`` at ``dst_offset``
    (``FICLONERANGE``; the whole file with ``FICLONE`` when ``length`` is 0). Offsets and length
    must be block-aligned, or the range must run to the end of both files. Returns False when the
    filesystem cannot clone it (the destination is then unchanged)."""
    try:
        if length == 0:
            fcntl.ioctl(dst_fd, FICLONE, src_fd)
        else:
            fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("qQQQ", src_fd, src_offset, length, dst_offset))
    except OSError as exc:
        if exc.errno in _NO_CLONE:
            return False
        raise
    return True


def pwrite_all(fd: int, data: Any, pos: int) -> int:
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        n = os.pwrite(fd, view, pos)
        view = view[n:]
        pos += n
    return total


def fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_or_copy(src: Path, dst: Path, *, fsync: bool = True, link: bool = True) -> str:
    """Hard-link a file (with ``link=False``, or where linking fails: :func:`copy_file`);
    recreate symlinks; recurse into directories. Returns how a file came over: linked, cloned,
    copied or streamed (a directory or symlink: linked)."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        os.mkdir(dst)
        for child in sorted(os.listdir(src)):
            link_or_copy(src / child, dst / child, fsync=fsync, link=link)
    else:
        if link:
            try:
                os.link(src, dst)
                return "linked"
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
        return copy_file(src, dst, fsync=fsync)
    return "linked"


def copy_file(src: Path, dst: Path, *, fsync: bool = True) -> str:
    """An independent copy of the regular file ``src`` at ``dst`` (which must not exist), with its
    mode and times: cloned where the filesystem can (``FICLONE``: no data is copied, no space
    used until either changes), else copied by the kernel (``copy_file_range``), else streamed.
    Returns which ("cloned", "copied" or "streamed")."""
    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(sfd).st_size
            how = "cloned"
            if not clone(sfd, dfd):
                done = copy_range(sfd, dfd, 0, 0, size) if size else 0
                how = "copied"
                if done < size:
                    os.lseek(sfd, done, os.SEEK_SET)
                    os.lseek(dfd, done, os.SEEK_SET)
                    with open(sfd, "rb", closefd=False) as fin, open(dfd, "wb", closefd=False) as fout:
                        shutil.copyfileobj(fin, fout)
                    how = "streamed"
            shutil.copystat(src, dst)
            if fsync:
                os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return how


def copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
    """Copy with copy_file_range; returns the bytes it copied (less when the kernel cannot)."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, src_offset + done, dst_offset + done)
        except OSError as exc:
            if exc.errno in _NO_KERNEL_COPY:
                return done
            raise
        if n == 0:
            raise InputError("source shard is shorter than its header says",
                             "the source is truncated: verify and repair it first")
        done += n
    return done
