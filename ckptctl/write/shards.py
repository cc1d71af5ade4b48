"""The bytes of one shard file.

:func:`create_shard` creates the file with its header and its whole data area (the single-process
writer and every rank of the multi-rank writer create shards only through it);
:func:`write_into` places tensors at their planned offsets through a :class:`TensorWriter`:
ranges of safetensors files that keep their dtype are copied by the kernel
(``copy_file_range``), everything else streams in bounded chunks. :func:`link_or_copy` brings a
file that does not change (an unchanged shard, a carried file) into the new version.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Mapping

from ckptctl import _faults
from ckptctl.errors import InputError
from ckptctl.plan import ShardPlan
from ckptctl.write.inputs import Entry

# copy_file_range cannot copy between these files: stream the rest instead.
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF)
# os.link cannot link here: copy instead.
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES)


def create_shard(path: Path, shard: ShardPlan) -> int:
    """Create ``path`` (it must not exist) with ``shard``'s header and its data area allocated to
    the planned file size; returns the descriptor, open for writing. The caller closes it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        pwrite_all(fd, shard.header, 0)
        os.ftruncate(fd, shard.file_size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_into(fd: int, shard: ShardPlan, entries: Mapping[str, Entry], tw: "TensorWriter", *,
               only: Container[str] | None = None, on_tensor: Callable[[int], None] | None = None) -> int:
    """Write ``shard``'s tensors (those named in ``only``, default all) at their planned offsets
    in the file open at ``fd``; returns the data bytes written."""
    written = 0
    for info in shard.layout:
        if only is not None and info.name not in only:
            continue
        tw.write(fd, shard.data_start + info.begin, entries[info.name], info.nbytes)
        written += info.nbytes
        if on_tensor is not None:
            on_tensor(info.nbytes)
    return written


class TensorWriter:
    """Writes tensors' bytes at given file positions and counts how: ``copied`` by the kernel,
    ``streamed`` through Python. Keeps the source files it copies from open until :meth:`close`."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.copied = 0
        self.streamed = 0
        self._src_fds: dict[str, int] = {}

    def close(self) -> None:
        for fd in self._src_fds.values():
            os.close(fd)
        self._src_fds.clear()

    def _src_fd(self, path: str) -> int:
        fd = self._src_fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._src_fds[path] = fd
        return fd

    def write(self, fd: int, pos: int, e: Entry, length: int) -> None:
        t = e.tensor
        copied = 0
        if not e.converted and t.file is not None and t.offset is not None and length:
            copied = _copy_range(self._src_fd(t.file), fd, t.offset, pos, length)
            self.copied += copied
        if copied < length:
            written = copied
            for chunk in _chunks_from(e, copied, self.chunk_bytes):
                n = pwrite_all(fd, chunk, pos + written)
                written += n
                self.streamed += n
                _faults.point("write-chunk")
            if written != length:
                raise InputError(f"tensor {t.name!r}: source gave {written} bytes, expected {length}",
                                 "the source is truncated or changed while it was read")
        _faults.point("write-data")


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


def link_or_copy(src: Path, dst: Path, *, fsync: bool = True) -> None:
    """Hard-link a file (copy where linking fails, and fsync the copy); recreate symlinks;
    recurse into directories."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        os.mkdir(dst)
        for child in sorted(os.listdir(src)):
            link_or_copy(src / child, dst / child, fsync=fsync)
    else:
        try:
            os.link(src, dst)
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
            shutil.copy2(src, dst)
            if fsync:
                fsync_and_close(os.open(dst, os.O_RDONLY | os.O_CLOEXEC))


def _copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
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


def _chunks_from(e: Entry, skip: int, chunk_bytes: int) -> Iterable[Any]:
    """The entry's stored bytes, starting ``skip`` bytes in (a kernel copy stopped there; only
    when not converting)."""
    target = e.dtype if e.converted else None
    if skip == 0:
        yield from e.source.chunks(e.tensor, target, chunk_bytes)
        return
    assert target is None
    seen = 0
    for chunk in e.source.chunks(e.tensor, None, chunk_bytes):
        view = memoryview(chunk).cast("B")
        if seen + len(view) <= skip:
            seen += len(view)
            continue
        start = max(0, skip - seen)
        seen += len(view)
        yield view[start:]
