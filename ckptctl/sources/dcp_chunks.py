"""Where a DCP tensor's bytes sit in its ``.distcp`` files, for a copy by the kernel.

torch's ``FileSystemWriter`` stores each chunk of a tensor (``ChunkStorageMetadata``: offsets and
sizes in the global tensor) as one ``torch.save`` zip archive at the ``offset``/``length`` the
``.metadata`` storage map gives. Inside that archive the chunk's storage is an uncompressed record
(``archive/data/0``) and ``archive/data.pkl`` says how the tensor views it (storage type, storage
offset, size, stride). That pickle is read with an allow-list unpickler whose globals are our own
record builders: nothing it names is imported or run.

A chunk whose view is contiguous and which is a contiguous run of the global tensor in row-major
order (the whole tensor, or rows ``[a, b)`` of a dim-0 sharding, or any block that only splits the
first dimension it does not cover whole) becomes one :class:`~ckptctl.sources.base.Piece`: copy
``nbytes`` from ``file`` at ``src_offset`` to ``dst_offset`` of the tensor's bytes. A tensor gets
pieces only when every chunk is such a run and together they tile the tensor exactly; any other
tensor (a column-sharded one, a compressed or extension-transformed chunk, a dtype without a
legacy storage name) streams through ``dcp.load`` as before.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import struct
from dataclasses import dataclass
from typing import Any

from ckptctl.format.dcp_metadata import MetadataIndex
from ckptctl.sources.base import Piece
from ckptctl.sources.torch_archive import zip_members

MAX_PICKLE_BYTES = 64 * 1024  # one tensor's data.pkl is a few hundred bytes


@dataclass(frozen=True)
class _Storage:
    key: str
    type_name: str
    numel: int


@dataclass(frozen=True)
class _View:
    storage: _Storage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any, *_rest: Any) -> _View:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("tensor without a storage")
    return _View(storage, int(storage_offset), tuple(int(x) for x in size), tuple(int(x) for x in stride))


class _StorageName(str):
    """The name of a ``torch.<X>Storage`` global, resolved to itself."""


class _ViewUnpickler(pickle.Unpickler):
    """Reads ``torch._utils._rebuild_tensor_v2(persistent storage, offset, size, stride, ...)``
    into a :class:`_View`; every other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "torch" and name.endswith("Storage"):
            return _StorageName(name)
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"global {module}.{name} is not read")

    def persistent_load(self, pid: Any) -> _Storage:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageName) or not isinstance(pid[2], str)):
            raise pickle.UnpicklingError("not a storage reference")
        return _Storage(pid[2], str(pid[1]), int(pid[4]))


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


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(size):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def chunk_bytes_at(fd: int, start: int, length: int, storage_name: str, size: tuple[int, ...],
                   itemsize: int) -> int | None:
    """The absolute offset in the file open at ``fd`` of the contiguous bytes of the chunk whose
    ``torch.save`` archive is stored at ``start`` (``length`` bytes), or None when they are not
    there as one contiguous, uncompressed, little-endian range of ``size`` elements of the storage
    type ``storage_name``. Raises OSError."""
    view_file = _Slice(fd, start, length)
    members = zip_members(view_file)
    pkl = next((v for k, v in members.items() if k.endswith("/data.pkl")), None)
    if pkl is None or pkl[1] > MAX_PICKLE_BYTES:
        return None
    raw = os.pread(fd, pkl[1], start + pkl[0])
    try:
        for _ in pickletools.genops(raw):  # every length field checked before the unpickler allocates
            pass
        view = _ViewUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            RecursionError, OverflowError, struct.error, UnicodeDecodeError):
        return None
    if not isinstance(view, _View) or view.size != size or view.storage.type_name != storage_name:
        return None
    if any(s != c for s, c, n in zip(view.stride, contiguous_strides(size), size) if n > 1):
        return None
    record = next((v for k, v in members.items() if k.split("/")[1:] == ["data", view.storage.key]), None)
    numel = math.prod(size)
    if (record is None or view.storage_offset < 0 or record[1] != view.storage.numel * itemsize
            or (view.storage_offset + numel) * itemsize > record[1]):
        return None
    return start + record[0] + view.storage_offset * itemsize


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
    return sum(o * s for o, s in zip(offsets, contiguous_strides(full)))


def tensor_pieces(root: Any, fqn: str, item: Any, storage: Any, itemsize: int, storage_name: str | None,
                  fds: dict[str, int]) -> tuple[Piece, ...]:
    """The pieces of the DCP tensor ``fqn`` (its ``TensorStorageMetadata`` ``item``), or ``()``
    when it must stream. ``storage`` is the metadata's storage map (already checked to lie inside
    ``root``); ``fds`` caches open ``.distcp`` descriptors (the caller closes them)."""
    full = tuple(int(x) for x in item.size)
    numel = math.prod(full)
    if storage_name is None or not numel or not isinstance(item.chunks, (list, tuple)):
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
        fd = fds.get(path)
        if fd is None:
            fd = fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        at = chunk_bytes_at(fd, int(info.offset), int(info.length), storage_name, sizes, itemsize)
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
