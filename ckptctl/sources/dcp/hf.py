"""torch's DCP-HF sharded output as a source: what ``torch.distributed.checkpoint``'s
``HuggingFaceStorageWriter`` writes with ``save_distributed=True`` (into ``ROOT/sharded/`` with
``enable_consolidation``): ``shard-RRRRR-model-IIIII-of-NNNNN.safetensors`` files, each holding
every rank's local shard of its tensors, whose header's ``__metadata__["DCP_SHARDING_INFO"]`` (a
JSON text) gives each one's ``saved_offsets`` into the global tensor. The global shape is not
stored: like torch's own reader, it is the largest ``offset + size`` of each dimension.

Read from the headers alone (no torch). The shards of a tensor must tile it exactly: same dtype
and rank in every file, no overlap, no hole (a missing or truncated file, a stray copy); anything
else is refused before a byte is written. A tensor whose shards are few contiguous runs of it
(the whole tensor, dim-0 shards, or blocks split along an outer dimension into runs of at least
``MIN_RUN_BYTES``) becomes :class:`~ckptctl.sources.base.Piece` s for the kernel to copy; any
other (column shards) streams through :meth:`DcpHfSource.chunks`, which assembles the tensor in
windows of about ``chunk_bytes`` (one ``pread`` per shard and window), so memory stays bounded for
every dtype. ``chunks`` is also the reference the pieces are tested against (``max_pieces=0``
streams everything).

:func:`open_dcp_hf` is what ``sources/opener.py`` asks first. At a root that holds both torch's
consolidated files and ``sharded/`` (torch leaves it there), a complete consolidated family that
holds the same tensors (names, dtypes, shapes) is read as any safetensors checkpoint (it is
cheaper, and what loaders see); an absent or incomplete one (torch 2.13's consolidation fails on
integer and bool tensors) gives way to ``sharded/``; a complete one that disagrees is refused.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ckptctl.errors import CkptctlError, InputError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format.dcp_hf_names import SHARDED_DIR, absent_shard, missing_models
from ckptctl.format.header import DuplicateKey, no_duplicate_keys
from ckptctl.format.tensor import strides
from ckptctl.sources.base import (CHUNK_BYTES, FileId, Piece, Source, SourceTensor, changed, convert_bytes,
                                  open_checked, read_pinned)
from ckptctl.sources.dcp.locate import SHARDING_KEY, find_sharded, safetensors_in

if TYPE_CHECKING:
    from ckptctl.layout.reading import MetadataReading

OFFSETS_KEY = "saved_offsets"
KIND = "dcp-hf"
MAX_PIECES = 1024  # runs per tensor beyond which it streams (a Piece is ~120 bytes)
MIN_RUN_BYTES = 1 << 20  # runs smaller than this (column shards) stream, unless one per shard
_HINT = "copy the shard files again, or save the checkpoint again"


@dataclass(frozen=True, slots=True)
class Block:
    """One local shard of a tensor: its bytes at ``start`` of ``file`` (row-major, ``sizes``),
    placed at ``offsets`` of the global tensor."""

    file: str
    start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def where(self) -> str:
        return f"{Path(self.file).name} (offsets {list(self.offsets)}, shape {list(self.sizes)})"


def _sharding_info(hdr: Any, shown: str) -> dict[str, Any] | None:
    """The header's parsed ``DCP_SHARDING_INFO``, or None when it has none."""
    raw = (hdr.metadata or {}).get(SHARDING_KEY)
    if raw is None:
        return None
    try:
        info = json.loads(raw, object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError, DuplicateKey) as exc:
        raise InputError(f"{shown}: {SHARDING_KEY} is not valid JSON ({type(exc).__name__})", _HINT) from None
    if not isinstance(info, dict):
        raise InputError(f"{shown}: {SHARDING_KEY} is not a JSON object", _HINT)
    return info


def _offsets(entry: Any, name: str, ndim: int, shown: str) -> tuple[int, ...]:
    offs = entry.get(OFFSETS_KEY) if isinstance(entry, dict) else None
    if (not isinstance(offs, list) or len(offs) != ndim
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
        raise InputError(f"{shown}: {SHARDING_KEY} gives tensor {name!r} no valid {OFFSETS_KEY} "
                         f"({ndim} non-negative integers expected, got {str(offs)[:60]})", _HINT)
    return tuple(offs)


def read_blocks(d: Path, files: list[str], reading: "MetadataReading",
                pin: Callable[[str, FileId | None], None]) -> dict[str, tuple[str, list[Block]]]:
    """Every tensor of the DCP-HF shards ``files`` of ``d``: name -> (dtype, its blocks). Each
    must be a sound shard with sharding info; ``pin`` gets the version of each file read.
    Raises InputError."""
    if not files:
        raise InputError(f"{d}: no safetensors shards", "pass the directory torch's HuggingFaceStorageWriter wrote")
    out: dict[str, tuple[str, list[Block]]] = {}
    ndims: dict[str, int] = {}
    for n in files:
        path = d / n
        shown = str(path)
        hdr, ident = read_pinned(shown, lambda: reading.header(path, display=shown))
        pin(shown, ident)
        errors = [f for f in hdr.findings if f.severity == "error"]
        if errors:
            raise InputError(f"{errors[0].message} [{errors[0].code}]", errors[0].hint or _HINT)
        info = _sharding_info(hdr, shown)
        if info is None:
            raise InputError(f"{shown} has no {SHARDING_KEY} in its metadata: it is not a shard of this DCP-HF save",
                             f"move it out of {d}")
        extra = sorted(set(info) - set(hdr.tensors))
        if extra:
            raise InputError(f"{shown}: {SHARDING_KEY} lists {extra[0]!r}, which the file does not hold", _HINT)
        for name, ti in hdr.tensors.items():
            if name not in info:
                raise InputError(f"{shown}: tensor {name!r} has no entry in {SHARDING_KEY}", _HINT)
            shape = ti.shape
            blk = Block(str(path), hdr.data_start + ti.begin, _offsets(info[name], name, len(shape), shown), shape)
            have = out.get(name)
            if have is None:
                out[name] = (ti.dtype, [blk])
                ndims[name] = len(shape)
                continue
            first = have[1][0]
            if have[0] != ti.dtype or ndims[name] != len(shape):
                raise InputError(f"tensor {name!r} is {have[0]} {list(first.sizes)} in {Path(first.file).name} "
                                 f"but {ti.dtype} {list(shape)} in {n}: the shards disagree", _HINT)
            have[1].append(blk)
    return out


def global_shape(blocks: list[Block]) -> tuple[int, ...]:
    """As torch's reader infers it: the largest ``offset + size`` of each dimension."""
    return tuple(max(b.offsets[i] + b.sizes[i] for b in blocks) for i in range(len(blocks[0].sizes)))


def check_tiling(name: str, shape: tuple[int, ...], blocks: list[Block], absent: str = "") -> None:
    """The blocks cover every element of ``shape`` exactly once (``absent``: what the file names
    say is missing, for the message). Raises InputError."""
    live = [b for b in blocks if b.numel]
    ndim = len(shape)
    if ndim:  # sweep along the dimension the blocks split most
        axis = max(range(ndim), key=lambda i: len({b.offsets[i] for b in live}))
        active: list[Block] = []
        for b in sorted(live, key=lambda b: b.offsets[axis]):
            active = [a for a in active if a.offsets[axis] + a.sizes[axis] > b.offsets[axis]]
            for a in active:
                if all(a.offsets[i] < b.offsets[i] + b.sizes[i] and b.offsets[i] < a.offsets[i] + a.sizes[i]
                       for i in range(ndim)):
                    raise InputError(f"tensor {name!r}: the shards {a.where()} and {b.where()} overlap",
                                     "remove the stray or duplicate shard file, or save the checkpoint again")
            active.append(b)
    elif len(live) > 1:
        raise InputError(f"tensor {name!r}: the scalar is stored in {live[0].where()} and {live[1].where()}",
                         "remove the stray or duplicate shard file, or save the checkpoint again")
    covered, total = sum(b.numel for b in live), math.prod(shape)
    if covered != total:
        raise InputError(f"tensor {name!r}: its shards cover {covered} of the {total} elements of {list(shape)}: "
                         f"a shard file is missing{absent}, or the shards do not fit together",
                         "copy the missing shard-*.safetensors file or save the checkpoint again")


def run_count(b: Block, shape: tuple[int, ...]) -> tuple[int, int]:
    """How many contiguous runs of the global tensor block ``b`` is, and their length (elements)."""
    split = max((i for i in range(len(shape)) if b.sizes[i] != shape[i]), default=-1)
    if split < 0:
        return 1, b.numel
    return math.prod(b.sizes[:split]), math.prod(b.sizes[split:])


def block_pieces(b: Block, shape: tuple[int, ...], itemsize: int) -> Iterator[Piece]:
    """Block ``b`` as pieces: its contiguous runs of the global tensor, in its own order."""
    count, length = run_count(b, shape)
    if count == 1 and length == math.prod(shape):
        yield Piece(b.file, b.start, 0, length * itemsize)
        return
    split = max(i for i in range(len(shape)) if b.sizes[i] != shape[i])
    st = strides(shape)
    base = sum(o * s for o, s in zip(b.offsets, st))
    for r, idx in enumerate(itertools.product(*(range(n) for n in b.sizes[:split]))):
        dst = base + sum(i * s for i, s in zip(idx, st))
        yield Piece(b.file, b.start + r * length * itemsize, dst * itemsize, length * itemsize)


def tensor_pieces(blocks: list[Block], shape: tuple[int, ...], dtype: str, max_pieces: int) -> tuple[Piece, ...]:
    """The tensor's pieces, sorted by destination, or ``()`` when it must stream: more than
    ``max_pieces`` runs, or runs under ``MIN_RUN_BYTES`` where a shard is several runs."""
    d = dt.BY_NAME[dtype]
    live = [b for b in blocks if b.numel]
    if not live or d.bits % 8:
        return ()
    counts = [run_count(b, shape) for b in live]
    runs = sum(c for c, _ in counts)
    if runs > max_pieces or (runs > len(live) and min(n for _, n in counts) * d.itemsize < MIN_RUN_BYTES):
        return ()
    return tuple(sorted((p for b in live for p in block_pieces(b, shape, d.itemsize)), key=lambda p: p.dst_offset))


class DcpHfSource(Source):
    """The tensors of one DCP-HF shard directory, each reassembled from its blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blocks: dict[str, list[Block]] = {}
        self.shard_names: list[str] = []

    @classmethod
    def open(cls, d: Path, *, reading: "MetadataReading | None" = None, key: str | None = None,
             max_pieces: int = MAX_PIECES) -> "DcpHfSource":
        """The tensors of the shards in ``d`` (``key``: only those under ``key.``, named without
        it; ``max_pieces=0``: every tensor streams). Raises InputError."""
        from ckptctl.layout.reading import MetadataReading

        src = cls(path=d, kind=KIND)
        src.shard_names = safetensors_in(d)
        gone = missing_models(src.shard_names)
        if gone:
            raise InputError(f"{d}: {gone}: the tensors stored only there are gone",
                             "copy the missing shard files, or save the checkpoint again")
        found = read_blocks(d, src.shard_names, reading if reading is not None else MetadataReading(), src.pin)
        prefix, absent = f"{key}." if key else "", absent_shard(src.shard_names)
        for fqn in sorted(found):
            if not fqn.startswith(prefix):
                continue
            dtype, blocks = found[fqn]
            shape = global_shape(blocks)
            if dt.BY_NAME[dtype].bits % 8 and (len(blocks) > 1 or any(blocks[0].offsets)):
                raise InputError(f"tensor {fqn!r} is {dtype}, split into shards: sub-byte elements cannot be "
                                 "placed by offset", "save it unsharded (a full tensor on one rank)")
            check_tiling(fqn, shape, blocks, absent)
            name = fqn[len(prefix):]
            src.add(SourceTensor(name, dtype, shape, pieces=tensor_pieces(blocks, shape, dtype, max_pieces)), fqn)
            src.blocks[name] = blocks
        if not src.tensors:
            raise InputError(f"{d}: no tensors" + (f" under {key!r}" if key else ""),
                             "check --key against `ckptctl inspect` of the directory")
        return src

    def file_rows(self, shown: Path) -> list[dict[str, Any]]:
        """The shard files as inspect lists them (names relative to ``shown``, the path inspected)."""
        rel = os.path.relpath(self.path, shown)
        rows = []
        for n in self.shard_names:
            try:
                size: int | None = (self.path / n).stat().st_size
            except OSError:
                size = None
            rows.append({"name": n if rel == "." else f"{rel}/{n}", "size": size, "role": "weights"})
        return rows

    def place(self, t: SourceTensor, shown: Path) -> str:
        """Where ``t`` is stored, for inspect (relative to ``shown``): its file, or a glob over
        the shard files when several hold it."""
        files = {b.file for b in self.blocks[t.name]}
        rel = os.path.relpath(self.path, shown)
        name = Path(next(iter(files))).name if len(files) == 1 else "shard-*.safetensors"
        return name if rel == "." else f"{rel}/{name}"

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview | bytes]:
        """``t``'s bytes in row-major order, a window of about ``chunk_bytes`` at a time (each
        converted to ``target_dtype`` when given), assembled from its blocks."""
        blocks = [b for b in self.blocks[t.name] if b.numel]
        if not blocks or not t.nbytes:
            return
        convert = target_dtype is not None and target_dtype != t.dtype
        fds: dict[str, int] = {}
        try:
            for part in _assemble(t.shape, dt.BY_NAME[t.dtype], blocks, chunk_bytes, _Reader(fds, self.identity)):
                yield convert_bytes(part, t.dtype, target_dtype) if convert else part  # type: ignore[arg-type]
            for f, fd in fds.items():  # the versions the listing read, still
                if FileId.of(os.fstat(fd)) != self.identity(f):
                    raise changed(f)
        except OSError as exc:
            raise from_oserror(exc, f"cannot read tensor {t.name!r}", phase="write") from None
        finally:
            for fd in fds.values():
                os.close(fd)


@dataclass(frozen=True, slots=True)
class _Reader:
    """``pread`` of the shard files, each opened once (the version the listing read: ``expect``)."""

    fds: dict[str, int]
    expect: Callable[[str], FileId | None]

    def __call__(self, file: str, n: int, at: int) -> bytes:
        fd = self.fds.get(file)
        if fd is None:
            fd = self.fds[file] = open_checked(file, self.expect(file))[0]
        data = os.pread(fd, n, at)
        if len(data) != n:
            raise InputError(f"{file} is shorter than its header says", "the shard is truncated: " + _HINT)
        return data


def _windows(shape: tuple[int, ...], itemsize: int,
             chunk_bytes: int) -> Iterator[tuple[tuple[int, ...], int, int, int]]:
    """Destination windows in row-major order, each ``(prefix, k, a, b)``: indices ``prefix``
    of the dimensions before ``k``, ``[a, b)`` of dimension ``k``, all of the ones after; ``k``
    is the outermost dimension whose one slice fits ``chunk_bytes``."""
    inner = [math.prod(shape[i + 1:]) * itemsize for i in range(len(shape))]
    k = next(i for i in range(len(shape)) if inner[i] <= chunk_bytes)
    step = max(1, chunk_bytes // inner[k])
    for prefix in itertools.product(*(range(n) for n in shape[:k])):
        for a in range(0, shape[k], step):
            yield prefix, k, a, min(a + step, shape[k])


def _assemble(shape: tuple[int, ...], d: dt.DType, blocks: list[Block], chunk_bytes: int,
              pread: Callable[[str, int, int], bytes]) -> Iterator[memoryview | bytes]:
    """The global tensor's bytes, window by window (the blocks tile it: checked at open)."""
    isz = d.itemsize
    chunk_bytes = max(chunk_bytes, isz)
    if not shape or d.bits % 8:  # a scalar, or a sub-byte tensor (one block: checked at open)
        b = blocks[0]
        yield pread(b.file, math.prod(shape) * d.bits // 8, b.start)
        return
    import numpy as np

    last = len(shape) - 1
    for prefix, k, a, z in _windows(shape, isz, chunk_bytes):
        parts = []
        for b in blocks:
            o, s = b.offsets, b.sizes
            if any(not (o[i] <= prefix[i] < o[i] + s[i]) for i in range(k)):
                continue
            lo, hi = max(a, o[k]), min(z, o[k] + s[k])
            if lo < hi:
                parts.append((b, lo, hi))
        if len(parts) == 1 and parts[0][1:] == (a, z) and parts[0][0].sizes[k + 1:] == shape[k + 1:]:
            b = parts[0][0]  # one block holds the whole window: its bytes as they are
            bst = strides(b.sizes)
            first = sum((p - b.offsets[i]) * bst[i] for i, p in enumerate(prefix)) + (a - b.offsets[k]) * bst[k]
            yield pread(b.file, (z - a) * bst[k] * isz, b.start + first * isz)
            continue
        dims = [z - a, *shape[k + 1:]]
        dims[-1] *= isz
        window = np.empty(dims, dtype=np.uint8)
        for b, lo, hi in parts:
            bst = strides(b.sizes)
            first = sum((p - b.offsets[i]) * bst[i] for i, p in enumerate(prefix)) + (lo - b.offsets[k]) * bst[k]
            raw = pread(b.file, (hi - lo) * bst[k] * isz, b.start + first * isz)
            got = [hi - lo, *b.sizes[k + 1:]]
            got[-1] *= isz
            where = [slice(lo - a, hi - a)] + [slice(b.offsets[i], b.offsets[i] + b.sizes[i])
                                               for i in range(k + 1, last + 1)]
            end = where[-1]
            where[-1] = slice(end.start * isz, end.stop * isz) if k < last else slice((lo - a) * isz, (hi - a) * isz)
            window[tuple(where)] = np.frombuffer(raw, dtype=np.uint8).reshape(got)
        yield memoryview(window.reshape(-1))


def _consolidated(root: Path, reading: "MetadataReading") -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """The tensors (name -> dtype, shape) of a complete safetensors family at ``root`` (every
    file sound, the index naming exactly them), or None when there is none."""
    from ckptctl import layout as L

    lay = L.scan(root, reading=reading)
    if not lay.families or lay.components or any(f.severity == "error" for f in lay.findings):
        return None
    try:
        fam = L.choose(lay)
    except CkptctlError:
        return None
    if fam.container != L.SAFETENSORS:
        return None
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for n in fam.files:
        hdr = reading.header(root / n, display=str(root / n))
        if not hdr.ok:
            return None
        specs.update((name, (ti.dtype, ti.shape)) for name, ti in hdr.tensors.items())
    doc = fam.index_doc
    if doc is not None and set(doc.weight_map) != set(specs):
        return None
    return specs


def open_location(found: tuple[bool, Path], p: Path, *, only: str | None = None, key: str | None = None,
                  reading: "MetadataReading | None" = None, max_pieces: int | None = None,
                  **_: Any) -> DcpHfSource | None:
    """The registry's open hook (``sources/kinds.py``): the DCP-HF save :func:`find_sharded` found
    at ``p`` (``found``), or None when ``p`` is a root whose complete consolidated files hold the
    same tensors (read as safetensors), unless ``only`` names this kind (``--only dcp-hf``: the
    sharded save is read even beside them). ``max_pieces``: :meth:`DcpHfSource.open`'s; unset, the
    ``pieces`` fast path's switch (``ckptctl.fastpaths``). Raises InputError (a damaged save;
    consolidated files that disagree with ``sharded/``)."""
    from ckptctl import layout as L
    from ckptctl.layout.reading import MetadataReading

    from ckptctl.fastpaths import enabled

    is_root, d = found
    reading = reading if reading is not None else MetadataReading()
    if max_pieces is None:
        max_pieces = MAX_PIECES if enabled("pieces") else 0
    forced = only is not None
    consolidated = _consolidated(p, reading) if is_root and not key and not forced else None  # --key: a DCP notion
    try:
        src = DcpHfSource.open(d, reading=reading, key=key, max_pieces=max_pieces)
    except InputError:
        if consolidated is not None:  # a damaged leftover beside torch's complete consolidation
            return None
        raise
    if consolidated is not None:
        mine = {t.name: (t.dtype, t.shape) for t in src.tensors}
        src.close()
        if mine == consolidated:
            return None
        diff = sorted(set(mine) ^ set(consolidated)) or sorted(n for n in mine if mine[n] != consolidated[n])
        raise InputError(f"{p}: the consolidated weights and {SHARDED_DIR}/ disagree (first: {diff[0]!r}); "
                         "which one is the checkpoint is not certain",
                         f"export one: `ckptctl export {d} DST` (the sharded save) or `--only safetensors` "
                         "(the consolidated files); nothing was changed")
    if is_root or not forced:
        lay = L.scan(p, reading=reading)
        src.extras = [lay.root / n for n in lay.extras if n in L.COPIED_EXTRAS]
    return src


def open_dcp_hf(p: Path, *, key: str | None = None, reading: "MetadataReading | None" = None,
                max_pieces: int | None = None) -> DcpHfSource | None:
    """:func:`open_location` of whatever :func:`find_sharded` finds at ``p``; None when nothing."""
    found = find_sharded(p)
    return None if found is None else open_location(found, p, key=key, reading=reading, max_pieces=max_pieces)
