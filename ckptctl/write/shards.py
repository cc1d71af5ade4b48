"""The bytes of one shard file.

:func:`create_shard` creates the file with its header and its whole data area (the single-process
writer and every rank of the multi-rank writer create shards only through it);
:func:`write_into` places tensors at their planned offsets through a :class:`TensorWriter`:
consecutive tensors that sit back to back in one safetensors file and keep their dtype are one
range (a :class:`~ckptctl.plan.Run`), split into an unaligned head copied by the kernel
(``copy_file_range``), a block-aligned middle (or one running to both files' end) cloned by the
filesystem where it can (``FICLONERANGE``: XFS, btrfs, ZFS 2.2+, bcachefs share the blocks) and
a tail copied by the kernel; everything else streams in bounded chunks. :func:`write_shard`
clones a whole source file when the shard is exactly its bytes (``FICLONE``).
:func:`link_or_copy` brings a file that does not change (an unchanged shard, a carried file)
into the new version: a hard link, or with ``link=False`` an independent copy
(:func:`copy_file`: cloned where the filesystem can).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Mapping

from ckptctl import _faults
from ckptctl.errors import InputError
from ckptctl.format.header import TensorInfo
from ckptctl.plan import Locate, Run, ShardPlan, runs
from ckptctl.sources.base import Piece
from ckptctl.write.digest import ShardDigest
from ckptctl.write.inputs import Entry

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


def create_shard(path: Path, shard: ShardPlan) -> int:
    """Create ``path`` (it must not exist) with ``shard``'s header and its data area allocated to
    the planned file size; returns the descriptor, open for writing (and reading: the manifest
    digest reads back what the kernel copied). The caller closes it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        pwrite_all(fd, shard.header, 0)
        os.ftruncate(fd, shard.file_size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_shard(path: Path, shard: ShardPlan, entries: Mapping[str, Entry], tw: "TensorWriter", *,
                on_tensor: Callable[[int], None] | None = None, locate: Locate | None = None) -> int:
    """Write all of ``shard`` at ``path`` (it must not exist): a clone of the source file when the
    shard is exactly that file's bytes and the filesystem can clone it, else :func:`create_shard`
    and :func:`write_into`. Returns the descriptor, open for writing; the caller fsyncs and
    closes it. With ``tw.hashing``, ``tw.digest`` is then the shard's :class:`ShardDigest`
    (its :meth:`~ShardDigest.finish` reads back what the kernel copied, before the close).
    ``locate``: :func:`source_range` of ``entries``, when the caller made it once for every shard."""
    if locate is None:
        locate = source_range(shard_entries(shard.layout, entries))
    parts = runs(shard.layout, locate)
    tw.digest = None
    src = whole_file_source(shard, parts)
    if src is not None:
        fd = tw.clone_file(src, path, shard.file_size)
        if fd is not None:
            if tw.hashing:
                try:
                    tw.digest = ShardDigest(fd)
                except BaseException:
                    os.close(fd)
                    raise
                tw.digest.final(0, shard.file_size)
            if on_tensor is not None:
                on_tensor(shard.data_bytes)
            return fd
    fd = create_shard(path, shard)
    try:
        if tw.hashing:
            tw.digest = ShardDigest(fd)
            tw.digest.written(0, shard.header)
        write_into(fd, shard, entries, tw, on_tensor=on_tensor, parts=parts)
    except BaseException:
        os.close(fd)
        if tw.digest is not None:
            tw.digest.close()
        raise
    return fd


def source_range(entries: Mapping[str, Entry]) -> Locate:
    """Where each of ``entries``' tensors' bytes sit unchanged in a source file (``(file,
    offset)``), or None when they must be produced (converted, or the source has no file range).
    Computed once for all of ``entries`` (give a shard's own): the lookup is a dict's."""
    out: dict[str, tuple[str, int]] = {}
    for name, e in entries.items():
        if e.converted:
            continue
        t = e.tensor
        pieces = t.pieces
        if pieces and len(pieces) == 1:  # one piece holds the whole tensor: a range like any other
            out[name] = (pieces[0].file, pieces[0].src_offset)
        elif t.file is not None and t.offset is not None:
            out[name] = (t.file, t.offset)
    return out.get


def shard_entries(layout: Iterable[TensorInfo], entries: Mapping[str, Entry]) -> dict[str, Entry]:
    """The entries of the tensors in ``layout``."""
    return {i.spec.name: entries[i.spec.name] for i in layout}


def whole_file_source(shard: ShardPlan, parts: list[Run | TensorInfo]) -> str | None:
    """The source file that holds exactly ``shard``'s bytes (same size, same header bytes, every
    tensor at the same offset), or None. ``parts`` are the shard's :func:`runs`."""
    if len(parts) != 1 or not isinstance(parts[0], Run):
        return None
    run = parts[0]
    if run.begin != 0 or run.src_offset != shard.data_start or run.nbytes != shard.data_bytes:
        return None
    try:
        fd = os.open(run.file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != shard.file_size:
            return None
        head = os.pread(fd, shard.data_start, 0)
    finally:
        os.close(fd)
    return run.file if head == shard.header else None


def write_into(fd: int, shard: ShardPlan, entries: Mapping[str, Entry], tw: "TensorWriter", *,
               only: Container[str] | None = None, on_tensor: Callable[[int], None] | None = None,
               parts: list[Run | TensorInfo] | None = None) -> int:
    """Write ``shard``'s tensors (those named in ``only``, default all) at their planned offsets
    in the file open at ``fd``; returns the data bytes written. Runs of tensors contiguous in
    one source file are copied as one range (``parts``: the shard's :func:`runs`, when the
    caller has them already). ``on_tensor`` gets the bytes of each run or tensor written."""
    if parts is None or only is not None:
        layout = shard.layout if only is None else [i for i in shard.layout if i.name in only]
        parts = runs(layout, source_range(shard_entries(layout, entries)))
    written = 0
    digest = tw.digest if only is None else None
    for part in parts:
        if isinstance(part, Run):
            tw.copy_run(fd, shard.data_start + part.begin, entries, part)
        else:
            tw.write(fd, shard.data_start + part.begin, entries[part.name], part.nbytes)
        if digest is not None:
            digest.final(shard.data_start + part.begin, part.nbytes)
        written += part.nbytes
        if on_tensor is not None:
            on_tensor(part.nbytes)
    return written


class TensorWriter:
    """Writes tensors' bytes at given file positions and counts how: ``cloned`` by the
    filesystem (blocks shared with the source), ``copied`` by the kernel, ``streamed`` through
    Python. Keeps the source files it copies from open until :meth:`close`. With ``hashing``
    (``--manifest``), :func:`write_shard` hashes each shard as it writes it (``digest``)."""

    def __init__(self, chunk_bytes: int, *, hashing: bool = False) -> None:
        self.chunk_bytes = chunk_bytes
        self.hashing = hashing
        self.digest: ShardDigest | None = None  # the shard being written, when hashing
        self.cloned = 0
        self.copied = 0
        self.streamed = 0
        self._src_fds: dict[str, int] = {}
        self._src_blocks: dict[str, int] = {}  # each open source's block size

    def close(self) -> None:
        for fd in self._src_fds.values():
            os.close(fd)
        self._src_fds.clear()
        self._src_blocks.clear()

    def _src_fd(self, path: str) -> int:
        fd = self._src_fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._src_fds[path] = fd
            try:
                self._src_blocks[path] = os.fstatvfs(fd).f_bsize
            except BaseException:
                del self._src_fds[path]
                os.close(fd)
                raise
        return fd

    def count(self, how: str, nbytes: int) -> None:
        """Count a whole file that came over as ``how`` (see :func:`link_or_copy`)."""
        if how == "cloned":
            self.cloned += nbytes
        elif how == "copied":
            self.copied += nbytes
        elif how == "streamed":
            self.streamed += nbytes

    def clone_file(self, src: str, path: Path, size: int) -> int | None:
        """Create ``path`` as a clone of ``src`` (``size`` bytes); returns its descriptor, or
        None (and no file) when the filesystem cannot clone it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            cloned = clone(self._src_fd(src), fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        if not cloned:
            os.close(fd)
            os.unlink(path)
            return None
        self.cloned += size
        _faults.point("write-data")
        return fd

    def copy_run(self, fd: int, pos: int, entries: Mapping[str, Entry], run: Run) -> None:
        """Copy ``run`` (its tensors' entries are in ``entries``) to ``pos``: where source and
        destination are congruent modulo the block size, the unaligned head by the kernel, the
        aligned middle (to both files' end, or whole blocks) cloned, the tail by the kernel;
        otherwise all by the kernel; whatever the kernel cannot copy streams."""
        src_fd = self._src_fd(run.file)
        length, src_pos = run.nbytes, run.src_offset
        done, kernel = 0, True
        block = max(os.fstatvfs(fd).f_bsize, self._src_blocks[run.file])
        if length >= block and (src_pos - pos) % block == 0:
            head = min((-pos) % block, length)
            done = _copy_range(src_fd, fd, src_pos, pos, head)
            self.copied += done
            kernel = done == head
            rest = length - head
            at_end = src_pos + length == os.fstat(src_fd).st_size and pos + length == os.fstat(fd).st_size
            middle = rest if at_end else rest - rest % block
            if kernel and middle and clone(src_fd, fd, src_pos + head, pos + head, middle):
                self.cloned += middle
                done += middle
        if kernel and done < length:
            n = _copy_range(src_fd, fd, src_pos + done, pos + done, length - done)
            self.copied += n
            done += n
        offset = 0
        for e in (entries[i.spec.name] for i in run.infos) if done < length else ():
            # the kernel stopped at ``done``: stream from there
            n = e.tensor.nbytes
            if offset + n > done:
                self._stream(fd, pos + offset, e, n, max(0, done - offset))
                _faults.point("write-data")
            offset += n
        _faults.point("write-data")

    def write(self, fd: int, pos: int, e: Entry, length: int) -> None:
        """One tensor that has no single source range to copy: its pieces copied by the kernel
        (a DCP tensor sharded by rows), or streamed (converted on the way), also when the
        kernel cannot copy a piece whole."""
        if not e.converted and e.tensor.pieces and self._copy_pieces(fd, pos, e.tensor.pieces):
            _faults.point("write-data")
            return
        self._stream(fd, pos, e, length, 0)
        _faults.point("write-data")

    def _copy_pieces(self, fd: int, pos: int, pieces: Iterable[Piece]) -> bool:
        """Copy every piece by the kernel; False when it cannot copy one whole (the caller then
        streams the tensor, and what was copied counts as streamed)."""
        total = 0
        for p in pieces:
            n = _copy_range(self._src_fd(p.file), fd, p.src_offset, pos + p.dst_offset, p.nbytes)
            if n < p.nbytes:
                return False
            total += n
        self.copied += total
        return True

    def _stream(self, fd: int, pos: int, e: Entry, length: int, skip: int) -> None:
        written = skip
        for chunk in _chunks_from(e, skip, self.chunk_bytes):
            if self.digest is not None:
                self.digest.written(pos + written, chunk)
            n = pwrite_all(fd, chunk, pos + written)
            written += n
            self.streamed += n
            _faults.point("write-chunk")
        if written != length:
            raise InputError(f"tensor {e.tensor.name!r}: source gave {written} bytes, expected {length}",
                             "the source is truncated or changed while it was read")


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
                done = _copy_range(sfd, dfd, 0, 0, size) if size else 0
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
