"""The bytes of one shard file.

:func:`create_shard` creates the file with its header and its whole data area (the single-process
writer and every rank of the multi-rank writer create shards only through it);
:func:`write_into` places tensors at their planned offsets through a :class:`TensorWriter`:
consecutive tensors that sit back to back in one safetensors file and keep their dtype are one
range (a :class:`~ckptctl.plan.Run`), split into an unaligned head copied by the kernel
(``copy_file_range``), a block-aligned middle (or one running to both files' end) cloned by the
filesystem where it can (``FICLONERANGE``: XFS, btrfs, ZFS 2.2+, bcachefs share the blocks) and
a tail copied by the kernel; everything else streams in bounded chunks. :func:`write_shard`
clones a whole source file when the shard is exactly its bytes (``FICLONE``). The file-level
primitives (clone, kernel copy, link or copy of a whole file) are in :mod:`ckptctl.write.files`.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Mapping

from ckptctl import _faults, _libc
from ckptctl.errors import InputError
from ckptctl.format.header import TensorInfo
from ckptctl.plan import Locate, Run, ShardPlan, runs
from ckptctl.sources.base import OpenFile, OpenFiles, Piece
from ckptctl.write.digest import ShardDigest
from ckptctl.write.files import clone, copy_range, pwrite_all
from ckptctl.write.inputs import Entry

# With fsync, writeback of copied or streamed bytes is started every this many bytes.
WRITEBACK_STEP = 16 << 20
# With --manifest, shards whose digests read back behind the copy at once (see write/digest.py).
EARLY_READERS = 2
_PAGE = 4096  # a hint ends on a page boundary: a page under writeback is never written again
# fallocate failed for want of space or of a working device: that is the write's error. Any other
# (EOPNOTSUPP on NFSv3 and FUSE, ENOSYS, EINVAL, EPERM from a seccomp filter, EINTR): ftruncate.
_ALLOCATE_FAILS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)
# sync_file_range is not taken here (a pipe, an old kernel, a filesystem without it): no hints.
_NO_HINT = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE)


def create_shard(path: Path, shard: ShardPlan, *, allocate: bool = True) -> int:
    """Create ``path`` (it must not exist) with ``shard``'s header and its data area at the
    planned file size; returns the descriptor, open for writing (and reading: the manifest
    digest reads back what the kernel copied). The caller closes it.

    With ``allocate`` the data area's blocks are reserved up front (``fallocate``): a full disk
    fails here, before any tensor is copied, and ext4 then writes 2 GB of copied tensors with
    0.16 s less cpu than into a sparse file (see bench/README.md). Where the filesystem cannot
    allocate, or where blocks will be shared with the source instead (``allocate=False``: a
    clone over reserved blocks would only free them again), the size is set by ``ftruncate``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        pwrite_all(fd, shard.header, 0)
        if not (allocate and shard.data_bytes and _allocate(fd, shard.data_start, shard.data_bytes)):
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
        fd = tw.clone_file(src, path, shard.file_size, entries[parts[0].infos[0].spec.name].source)
        if fd is not None:
            if tw.hashing:
                try:
                    tw.digest = ShardDigest(fd, gate=tw.gate)
                except BaseException:
                    os.close(fd)
                    raise
                tw.digest.final(0, shard.file_size)
            if on_tensor is not None:
                on_tensor(shard.data_bytes)
            return fd
    fd = create_shard(path, shard, allocate=tw.allocate)
    try:
        if tw.hashing:
            tw.digest = ShardDigest(fd, gate=tw.gate)
            tw.digest.written(0, shard.header)
        write_into(fd, shard, entries, tw, on_tensor=on_tensor, parts=parts)
    except BaseException:
        os.close(fd)
        if tw.digest is not None:
            tw.digest.close()
        raise
    return fd


def _allocate(fd: int, offset: int, length: int) -> bool:
    """fallocate ``[offset, offset + length)`` of ``fd``; False where the filesystem cannot."""
    try:
        _libc.fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in _ALLOCATE_FAILS:
            raise
        return False
    return True


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
    tw.start_file()
    digest = tw.digest if only is None else None
    for part in parts:
        try:
            if isinstance(part, Run):
                tw.copy_run(fd, shard.data_start + part.begin, entries, part)
            else:
                tw.write(fd, shard.data_start + part.begin, entries[part.name], part.nbytes)
        except InputError:
            tw.check_sources()  # a source that ended early because it was rewritten: changed while reading
            raise
        if digest is not None:
            digest.final(shard.data_start + part.begin, part.nbytes)
        written += part.nbytes
        if on_tensor is not None:
            on_tensor(part.nbytes)
    # after the last byte: none of the files read was replaced or rewritten, nor any other file
    # of the sources (a multi-file save replaces them one by one)
    tw.check_sources()
    return written


class TensorWriter:
    """Writes tensors' bytes at given file positions and counts how: ``cloned`` by the
    filesystem (blocks shared with the source), ``copied`` by the kernel, ``streamed`` through
    Python. Keeps up to ``MAX_OPEN_SOURCES`` of the source files it copies from open until
    :meth:`close`, each checked to be the version its source listed when it is opened and after
    each shard (:class:`~ckptctl.sources.base.OpenFiles`). With ``hashing``
    (``--manifest``), :func:`write_shard` hashes each shard as it writes it (``digest``)."""

    def __init__(self, chunk_bytes: int, *, hashing: bool = False, allocate: bool = True,
                 writeback: bool = False) -> None:
        self.chunk_bytes = chunk_bytes
        self.hashing = hashing
        self.allocate = allocate  # shards it creates get their blocks up front (see create_shard)
        # the shards will be fsynced: start writing each WRITEBACK_STEP back as soon as it is there
        self.writeback = writeback
        self._unflushed: tuple[int, int, int] | None = None  # (fd, lowest, highest) written since the last hint
        self.digest: ShardDigest | None = None  # the shard being written, when hashing
        # the early readers of every shard's digest, at most this many at once (they follow the
        # copy on the other core; a shard that cannot take one is hashed at its finish)
        self.gate = threading.Semaphore(EARLY_READERS) if hashing else None
        self.cloned = 0
        self.copied = 0
        self.streamed = 0
        # the source files: a bounded number open at once, each the version the source listed
        self._sources = OpenFiles()
        self._read_from: dict[int, Any] = {}  # the sources read since the last check, by id
        # the source of each file copied from (path -> source: an export's files are each listed by
        # one source), so a run does not look its first tensor's entry up: among 90k entries that
        # look-up missed the cache, 1.3 us a run, 8 ms of a 91,991-tensor export
        self._source_of: dict[str, Any] = {}

    def _reading(self, source: Any) -> None:
        """``source``'s bytes are being written: :meth:`check_sources` checks its files next."""
        if source is not None and id(source) not in self._read_from:
            self._read_from[id(source)] = source

    def close(self) -> None:
        self._sources.close()

    def _src(self, path: str, source: Any = None) -> OpenFile:
        """The source file ``path``, open: the version ``source`` listed (else changed while
        reading, exit 3); valid until the next call."""
        if source is None:
            return self._sources.file(path)
        if id(source) not in self._read_from:  # _reading's test, inline: once per run of tensors
            self._read_from[id(source)] = source
        return self._sources.file(path, source.identity)

    def check_sources(self) -> None:
        """The source files read since the last check are still the versions listed, and every
        file listed by a source read since then still is, by its name (one fstat or stat each;
        after every shard)."""
        sources, self._read_from = self._read_from, {}
        self._sources.check(*(source.pinned for source in sources.values()))

    def count(self, how: str, nbytes: int) -> None:
        """Count a whole file that came over as ``how`` (see :func:`link_or_copy`)."""
        if how == "cloned":
            self.cloned += nbytes
        elif how == "copied":
            self.copied += nbytes
        elif how == "streamed":
            self.streamed += nbytes

    def clone_file(self, src: str, path: Path, size: int, source: Any = None) -> int | None:
        """Create ``path`` as a clone of ``src`` (``size`` bytes; the version ``source`` listed);
        returns its descriptor, or None (and no file) when the filesystem cannot clone it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            cloned = clone(self._src(src, source).fd, fd)
            if cloned:
                self.check_sources()
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
        source = self._source_of.get(run.file)
        if source is None:
            source = self._source_of[run.file] = entries[run.infos[0].spec.name].source
        src_fd, _, block = self._src(run.file, source)  # a run shorter than block is never cloned
        length, src_pos = run.nbytes, run.src_offset
        done, kernel = 0, True
        if length >= block:
            block = max(os.fstatvfs(fd).f_bsize, block)
        if length >= block and (src_pos - pos) % block == 0:
            head = min((-pos) % block, length)
            done = self._copy(src_fd, fd, src_pos, pos, head)
            self.copied += done
            kernel = done == head
            rest = length - head
            at_end = src_pos + length == os.fstat(src_fd).st_size and pos + length == os.fstat(fd).st_size
            middle = rest if at_end else rest - rest % block
            if kernel and middle and clone(src_fd, fd, src_pos + head, pos + head, middle):
                self.cloned += middle
                done += middle
        if kernel and done < length:
            n = self._copy(src_fd, fd, src_pos + done, pos + done, length - done)
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
        self._reading(e.source)
        if not e.converted and e.tensor.pieces and self._copy_pieces(fd, pos, e.tensor.pieces, e.source):
            _faults.point("write-data")
            return
        self._stream(fd, pos, e, length, 0)
        _faults.point("write-data")

    def _copy_pieces(self, fd: int, pos: int, pieces: Iterable[Piece], source: Any = None) -> bool:
        """Copy every piece by the kernel; False when it cannot copy one whole (the caller then
        streams the tensor, and what was copied counts as streamed)."""
        total = 0
        for p in pieces:
            n = self._copy(self._src(p.file, source).fd, fd, p.src_offset, pos + p.dst_offset, p.nbytes)
            if n < p.nbytes:
                return False
            total += n
        self.copied += total
        return True

    def _copy(self, src_fd: int, fd: int, src_pos: int, pos: int, length: int) -> int:
        """:func:`~ckptctl.write.files.copy_range`; when the shards will be fsynced, in steps of ``WRITEBACK_STEP``,
        each one's writeback started as soon as it is copied, so the disk writes while the kernel
        copies and the fsync at the end waits for the last steps only (2 GB exported with fsync:
        1.12 -> 1.01 s, at ``cp -r`` + ``sync``; see bench/README.md)."""
        digest = self.digest
        if not self.writeback and digest is None:
            return copy_range(src_fd, fd, src_pos, pos, length)
        done = 0
        while done < length:
            step = min(WRITEBACK_STEP, length - done)
            n = copy_range(src_fd, fd, src_pos + done, pos + done, step)
            self._start_writeback(fd, pos + done, n)
            if digest is not None:  # the early reader hashes this step while the next is copied
                digest.progress(pos + done, n)
            done += n
            if n < step:  # the kernel cannot copy the rest: the caller streams it
                break
        return done

    def start_file(self) -> None:
        """A new shard file: what was written to the last one since the last hint is its fsync's."""
        self._unflushed = None

    def _start_writeback(self, fd: int, pos: int, length: int) -> None:
        """``[pos, pos + length)`` of ``fd`` is written: once ``WRITEBACK_STEP`` bytes of one file
        are, start their writeback (one hint for the span, however many small runs made it, up to
        its last whole page; the rest waits for the next hint or the fsync). A filesystem that
        does not take hints gets none; an I/O error from one fails the write at once."""
        if not (self.writeback and length):
            return
        last = self._unflushed
        lo, hi = pos, pos + length
        if last is not None and last[0] == fd:
            lo, hi = min(last[1], lo), max(last[2], hi)
        end = hi - hi % _PAGE
        if end - lo < WRITEBACK_STEP:
            self._unflushed = (fd, lo, hi)
            return
        self._unflushed = (fd, end, hi) if end < hi else None
        try:
            _libc.sync_file_range(fd, lo, end - lo)
        except OSError as exc:
            if exc.errno not in _NO_HINT:
                raise
            self.writeback = False  # the fsync alone decides

    def _stream(self, fd: int, pos: int, e: Entry, length: int, skip: int) -> None:
        written = skip
        for chunk in _chunks_from(e, skip, self.chunk_bytes):
            if self.digest is not None:
                self.digest.written(pos + written, chunk)
            n = pwrite_all(fd, chunk, pos + written)
            self._start_writeback(fd, pos + written, n)
            written += n
            self.streamed += n
            _faults.point("write-chunk")
        if written != length:
            raise InputError(f"tensor {e.tensor.name!r}: source gave {written} bytes, expected {length}",
                             "the source is truncated or changed while it was read")


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
