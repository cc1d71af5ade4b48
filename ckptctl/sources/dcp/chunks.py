"""Where a DCP tensor's bytes sit in its ``.distcp`` files, for a copy by the kernel.

torch's ``FileSystemWriter`` stores each chunk of a tensor (``ChunkStorageMetadata``: offsets and
sizes in the global tensor) as one ``torch.save`` zip archive at the ``offset``/``length`` the
``.metadata`` storage map gives. Inside that archive the chunk's storage is an uncompressed record
(``archive/data/0``) and ``archive/data.pkl`` says how the tensor views it (storage type, storage
offset, size, stride). The archive is read as any ``torch.save`` archive is
(:func:`ckptctl.sources.torch_archive.tensor_record`: the allow-list reader, nothing imported or run).

A chunk whose view is contiguous and which is a contiguous run of the global tensor in row-major
order (the whole tensor, or rows ``[a, b)`` of a dim-0 sharding, or any block that only splits the
first dimension it does not cover whole) becomes one :class:`~ckptctl.sources.base.Piece`: copy
``nbytes`` from ``file`` at ``src_offset`` to ``dst_offset`` of the tensor's bytes. A tensor gets
pieces only when every chunk is such a run and together they tile the tensor exactly; any other
tensor (a column-sharded one, a compressed or extension-transformed chunk, an archive the reader
refuses) streams through ``dcp.load`` as before.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Callable

from ckptctl.errors import InputError
from ckptctl.format import dtypes as dt
from ckptctl.format.dcp_metadata import MetadataIndex
from ckptctl.format.tensor import strides
from ckptctl.sources.base import Piece
from ckptctl.sources.torch_archive import tensor_record

MAX_PICKLE_BYTES = 64 * 1024  # one tensor's data.pkl is a few hundred bytes


class _Slice(io.RawIOBase):
    """``length`` bytes of the file open at ``fd`` from ``start``, as a seekable binary file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._start, self._len, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._len - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos) if n else b""
        buf[:len(data)] = data
        self._pos += len(data)
        return len(data)


def chunk_bytes_at(fd: int, start: int, length: int, dtype: str, size: tuple[int, ...]) -> int | None:
    """The absolute offset in the file open at ``fd`` of the contiguous bytes of the chunk whose
    ``torch.save`` archive is stored at ``start`` (``length`` bytes), or None when they are not
    there as one contiguous, uncompressed, little-endian range of ``size`` elements of the
    safetensors ``dtype`` (:func:`ckptctl.sources.torch_archive.tensor_record` reads the
    archive; whatever it refuses streams through ``dcp.load``, which decides). Raises OSError."""
    try:
        rec = tensor_record(io.BufferedReader(_Slice(fd, start, length)), f"chunk at {start}", MAX_PICKLE_BYTES)
    except InputError:
        return None
    if rec is None or rec.dtype != dtype or rec.shape != size or rec.offset is None:
        return None
    return start + rec.offset


def run_start(offsets: tuple[int, ...], sizes: tuple[int, ...], full: tuple[int, ...]) -> int | None:
    """The element index in the row-major ``full`` tensor where the block at ``offsets`` of
    ``sizes`` starts, when that block is one contiguous run of it; else None."""
    dims = len(full)
    if len(offsets) != dims or len(sizes) != dims:
        return None
    last_split = max((d for d in range(dims) if sizes[d] != full[d]), default=-1)
    if any(sizes[d] != 1 for d in range(last_split)):
        return None
    if any(o < 0 or o + n > f for o, n, f in zip(offsets, sizes, full)):
        return None
    return sum(o * s for o, s in zip(offsets, strides(full)))


def tensor_pieces(root: Any, fqn: str, item: Any, storage: Any, dtype: str,
                  open_fd: Callable[[str], int]) -> tuple[Piece, ...]:
    """The pieces of the DCP tensor ``fqn`` (its ``TensorStorageMetadata`` ``item``), or ``()``
    when it must stream. ``storage`` is the metadata's storage map (already checked to lie inside
    ``root``); ``open_fd(path)`` gives a descriptor of a ``.distcp`` file, valid until its next
    call (the caller's bounded set of open files, :class:`~ckptctl.sources.base.OpenFiles`)."""
    full = tuple(int(x) for x in item.size)
    numel = math.prod(full)
    itemsize = dt.BY_NAME[dtype].itemsize
    if not numel or not isinstance(item.chunks, (list, tuple)):
        return ()
    pieces: list[Piece] = []
    for chunk in item.chunks:
        offsets, sizes = tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)
        first = run_start(offsets, sizes, full)
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if first is None or info is None or getattr(info, "transform_descriptors", None):
            return ()
        count = math.prod(sizes)
        if not count:
            continue
        path = str(root / info.relative_path)
        at = chunk_bytes_at(open_fd(path), int(info.offset), int(info.length), dtype, sizes)
        if at is None:
            return ()
        pieces.append(Piece(path, at, first * itemsize, count * itemsize))
    pieces.sort(key=lambda p: p.dst_offset)
    pos = 0
    for p in pieces:  # they must tile the tensor: no gap, no overlap
        if p.dst_offset != pos:
            return ()
        pos += p.nbytes
    return tuple(pieces) if pos == numel * itemsize else ()
