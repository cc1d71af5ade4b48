"""Source protocol, and what every source reads its files through.

A source pins each file it lists (:meth:`Source.pin`: its :class:`FileId` as the listing read
it); its bytes are then read only from that version: :class:`OpenFiles` (the writer's bounded set
of open source files) and :func:`file_chunks` check the identity when they open a file and after
they read it, :func:`same_file` checks a file torch reads by its name, and a file that is not
the version listed is refused as :func:`changed` (exit 3), never mixed into an export."""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, TypeVar

from ckptctl.errors import InputError, OperationalError, UsageError
from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import SpecFields, TensorSpec
from ckptctl.sizes import CHUNK_BYTES

MAX_OPEN_SOURCES = 256  # source files a writer keeps open at once (fewer under a low ``ulimit -n``)
_T = TypeVar("_T")


class FileId(NamedTuple):
    """One version of a file: a file replaced by a rename is another inode, one rewritten in
    place has another mtime and ctime (unless the rewrite falls within the filesystem's timestamp
    granularity, the known limit of this check). Two are equal when the inode, size and mtime are
    and the ctime is too, unless the link count changed: a hard link to the file (resave links
    the shards it keeps) changes its ctime, not its bytes."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    nlink: int = 1

    @classmethod
    def of(cls, st: os.stat_result) -> "FileId":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileId):
            return NotImplemented
        return self[:4] == other[:4] and (self[4] == other[4] or self[5] != other[5])

    def __ne__(self, other: object) -> bool:
        same = self.__eq__(other)
        return same if same is NotImplemented else not same

    def __hash__(self) -> int:
        return hash(self[:4])


def key_refused(path: Path, kind: str, key: str, hint: str) -> UsageError:
    """The usage error of ``--key`` on a source that is not a nested state dict (exit 2)."""
    return UsageError(f"{path} is a {kind} checkpoint: --key {key} selects nothing in it", f"drop --key: {hint}")


def changed(path: str | os.PathLike[str]) -> OperationalError:
    """The error of a source file that is not the version the plan read (exit 3)."""
    return OperationalError(
        f"source {os.fspath(path)} changed while reading it (replaced or rewritten during the export)",
        "another process wrote the source while it was exported (a trainer saving its next step?); nothing "
        "was published: export a checkpoint that is no longer being written, or run the export again")


def read_pinned(path: str | os.PathLike[str], read: Callable[[], _T]) -> tuple[_T, FileId | None]:
    """``read()`` (which reads ``path`` by its name) and the identity of the file it read: the file
    is held open across the read, and it must be the same before, after, and still the file the
    name names afterwards; else :func:`changed`. The identity is None when ``path`` cannot be
    opened (``read()`` then says why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return read(), None
    try:
        before = FileId.of(os.fstat(fd))
        try:
            out = read()
        except InputError:  # a file being written looks damaged: that it changed is the reason
            if not _still(fd, path, before):
                raise changed(path) from None
            raise
        if not _still(fd, path, before):
            raise changed(path)
    finally:
        os.close(fd)
    return out, before


def _still(fd: int, path: str | os.PathLike[str], before: FileId) -> bool:
    """The file open at ``fd`` is still ``before``, and ``path`` still names it."""
    try:
        return FileId.of(os.fstat(fd)) == before and FileId.of(os.stat(path)) == before
    except FileNotFoundError:
        return False


def same_file(path: str | os.PathLike[str], expect: FileId | None) -> None:
    """``path`` (by its name) is still the file ``expect`` identifies; else :func:`changed`."""
    if expect is None:
        return
    try:
        now = FileId.of(os.stat(path))
    except FileNotFoundError:
        raise changed(path) from None
    if now != expect:
        raise changed(path)


def open_checked(path: str, expect: FileId | None, flags: int = 0) -> tuple[int, FileId]:
    """A read descriptor of ``path`` and its identity, which must be ``expect`` (when given)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        ident = FileId.of(os.fstat(fd))
        if expect is not None and ident != expect:
            raise changed(path)
    except BaseException:
        os.close(fd)
        raise
    return fd, ident


def open_limit() -> int:
    """How many source files to keep open at once: ``MAX_OPEN_SOURCES``, or a quarter of the
    process's descriptor limit where that is lower (at least 4)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_OPEN_SOURCES
    return max(4, min(MAX_OPEN_SOURCES, soft // 4))


class OpenFile(NamedTuple):
    """A source file an :class:`OpenFiles` pool holds open: its descriptor, the version it was
    opened as, and the block size of its filesystem."""

    fd: int
    ident: FileId
    block: int


class OpenFiles:
    """Source files open for reading, at most ``limit`` at once (the least recently used one is
    closed first, and opened again when needed). Each is checked when it is opened to be the
    version the plan read (``pins``; a path no source pinned keeps the identity it had when it
    was first opened), and again by :meth:`check` (and before it is closed to make room) after
    it was read: one ``fstat`` per file each time, none per chunk."""

    def __init__(self, limit: int | None = None, flags: int = 0) -> None:
        self.limit = limit or open_limit()
        self._flags = flags
        self._open: OrderedDict[str, OpenFile] = OrderedDict()
        self._seen: dict[str, FileId] = {}  # the identity each path was first opened with
        self._blocks: dict[str, int] = {}
        self._used: set[str] = set()  # read since the last check

    def fd(self, path: str, pins: Callable[[str], FileId | None] | None = None) -> int:
        """A descriptor of ``path``, open until this pool closes it (use it before the next call);
        ``pins`` as :meth:`file`'s."""
        return self.file(path, pins).fd

    def file(self, path: str, pins: Callable[[str], FileId | None] | None = None) -> OpenFile:
        """``path`` open for reading until this pool closes it (use it before the next call).
        ``pins``: the version a source listed of a path (its ``identity``), asked when the file is
        opened. A writer asks this once per run of tensors it copies, hence one look-up when the
        file is open."""
        hit = self._open.get(path)
        if hit is not None:
            self._open.move_to_end(path)
            self._used.add(path)
            return hit
        while len(self._open) >= self.limit:
            old, gone = self._open.popitem(last=False)
            try:
                if old in self._used:
                    self._used.discard(old)
                    if FileId.of(os.fstat(gone.fd)) != gone.ident:
                        raise changed(old)
            finally:
                os.close(gone.fd)
        fd, ident = open_checked(path, (pins(path) if pins is not None else None) or self._seen.get(path),
                                 self._flags)
        try:
            block = self._blocks.get(path) or os.fstatvfs(fd).f_bsize
        except BaseException:
            os.close(fd)
            raise
        self._blocks[path] = block
        self._seen.setdefault(path, ident)
        opened = self._open[path] = OpenFile(fd, ident, block)
        self._used.add(path)
        return opened

    def check(self, *pinned: Mapping[str, FileId]) -> None:
        """Every file read since the last check is still the version it was opened as, and every
        file opened so far, and every file of ``pinned`` (sources' :attr:`Source.pinned`), is
        still that version by its name: one ``stat`` per path, also for a path in both."""
        used, self._used = self._used, set()
        for path in used:
            hit = self._open.get(path)
            if hit is not None and FileId.of(os.fstat(hit.fd)) != hit.ident:
                raise changed(path)
        names = self._seen
        if pinned:
            names = dict(names)
            for table in pinned:
                for path, ident in table.items():
                    if names.setdefault(path, ident) != ident:  # two versions: one is not there now
                        raise changed(path)
        for path, ident in names.items():
            same_file(path, ident)

    def close(self) -> None:
        """Close every file (no check: :meth:`check` after the last read)."""
        while self._open:
            os.close(self._open.popitem()[1].fd)
        self._used.clear()


@dataclass(frozen=True)
class Piece:
    """``nbytes`` of a tensor's stored bytes that sit unchanged in ``file`` at ``src_offset``, to
    be placed ``dst_offset`` bytes into the tensor (a DCP chunk that is a contiguous run)."""

    file: str
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(init=False, slots=True)
class SourceTensor(SpecFields):
    """A tensor as a source lists it: its identity (``spec``) and, when its bytes can be copied as
    they are, the file and absolute offset where they sit (safetensors, pickles) or the
    :class:`Piece` s they are split into (DCP)."""

    spec: TensorSpec
    file: str | None = None
    offset: int | None = None  # absolute offset in ``file``
    # Where the bytes sit when they are split over files (a DCP checkpoint; ``file`` is then None,
    # since no single file holds the tensor): together the pieces tile the tensor's bytes.
    pieces: tuple[Piece, ...] = ()

    def __init__(self, spec: TensorSpec | str, dtype: str | None = None, shape: tuple[int, ...] | None = None,
                 file: str | None = None, offset: int | None = None, pieces: tuple[Piece, ...] = ()) -> None:
        # ``SourceTensor(name, dtype, shape)`` is still accepted for callers that build the spec
        # in place (resave's keep-layout plan, the DCP source). ``file`` and ``offset`` may be
        # given by position: a source of 90k tensors makes them with one ``map``.
        self.spec = spec if isinstance(spec, TensorSpec) else TensorSpec(spec, dtype, tuple(shape))  # type: ignore[arg-type]
        self.file = file
        self.offset = offset
        self.pieces = pieces


@dataclass
class Source:
    """Base class. Subclasses fill ``tensors`` and implement :meth:`chunks`."""

    path: Path
    kind: str
    tensors: list[SourceTensor] = field(default_factory=list)
    # Aliases dropped because they share storage with a kept tensor: {removed: kept}.
    aliases: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    # Files beside the weights that export copies (config, tokenizer, adapter_config, ...).
    extras: list[Path] = field(default_factory=list)
    is_adapter: bool = False
    # The library name of the family read (``model``, ``diffusion_pytorch_model``, ...; the
    # safetensors name of a pickle family) and its variant: an export writes the same names.
    stem: str | None = None
    variant: str | None = None
    # The files torch had to load (a view to gather, a tensor the records cannot describe, a DCP
    # tensor assembled by ``dcp.load``); empty when every byte came from the records.
    torch_loaded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what an export of it tells the user (a padded vocabulary kept)
    # Where each listed tensor came from (a file name), for the one duplicate check: :meth:`claim`.
    _origins: dict[str, str] = field(default_factory=dict, repr=False)
    # The version of each file the listing read (path -> identity): its bytes are read only from it.
    pinned: dict[str, FileId] = field(default_factory=dict, repr=False)

    def pin(self, path: str | os.PathLike[str], ident: FileId | None) -> None:
        """Record that the listing read ``ident`` at ``path``; a second, different version of
        the same path is :func:`changed`."""
        if ident is None:
            return
        key = os.fspath(path)
        first = self.pinned.setdefault(key, ident)
        if first != ident:
            raise changed(key)

    def identity(self, path: str | os.PathLike[str]) -> FileId | None:
        """The version of ``path`` the listing read, None when it pinned none."""
        return self.pinned.get(os.fspath(path))

    def claim(self, name: str, origin: str) -> None:
        """Record that tensor ``name`` comes from ``origin``; a name listed twice is refused here,
        once for every source (a tensor stored in two shards cannot be exported silently)."""
        first = self._origins.get(name)
        if first is not None:
            raise InputError(f"tensor {name!r} is stored in both {first} and {origin}",
                             f"run `ckptctl verify {self.path}` and repair the checkpoint first")
        self._origins[name] = origin

    def add(self, t: SourceTensor, origin: str) -> None:
        """List ``t`` (from ``origin``), refusing a name listed before."""
        self.claim(t.name, origin)
        self.tensors.append(t)

    def add_all(self, tensors: list[SourceTensor], names: list[str], origin: str) -> None:
        """:meth:`add` of each of ``tensors`` (named ``names``), by dict operations when no name
        repeats one listed before (or another of them); otherwise one by one, to refuse the first."""
        new = dict.fromkeys(names, origin)
        if len(new) != len(names) or not self._origins.keys().isdisjoint(new):
            for t in tensors:
                self.add(t, origin)
            return
        self._origins.update(new)
        self.tensors.extend(tensors)

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview | bytes]:
        """The tensor's bytes (converted to ``target_dtype`` when given), at most about
        ``chunk_bytes`` at a time."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def convert_bytes(raw: Any, src_dtype: str, dst_dtype: str) -> bytes:
    """Convert a byte buffer of ``src_dtype`` elements to ``dst_dtype`` (imports torch)."""
    import torch

    src = dt.BY_NAME[src_dtype]
    dst = dt.BY_NAME[dst_dtype]
    if len(raw) == 0:
        return b""
    t = torch.frombuffer(bytearray(raw), dtype=getattr(torch, src.torch_name))
    out = t.to(getattr(torch, dst.torch_name))
    return out.view(torch.uint8).numpy().tobytes()


def file_chunks(file: str, offset: int, total: int, src_dtype: str, target_dtype: str | None,
                chunk_bytes: int, short: str, expect: FileId | None = None) -> Iterator[bytes]:
    """``total`` bytes of ``src_dtype`` elements at ``offset`` of ``file`` (converted to
    ``target_dtype`` when given), read with ``pread`` at most about ``chunk_bytes`` at a time.
    ``short`` is the message when the file ends first. ``expect``: the version the plan read
    (checked when the file is opened and after its last chunk). Raises InputError, and
    OperationalError when the file changed (:func:`changed`)."""
    from ckptctl.errors import from_oserror

    src_bits = dt.BY_NAME[src_dtype].bits
    # Keep chunks on element boundaries so each one converts on its own.
    step = max(8, chunk_bytes - chunk_bytes % 8)
    try:
        fd, ident = open_checked(file, expect)
    except OSError as exc:
        raise from_oserror(exc, "cannot read source shard") from None
    try:
        done = 0
        while done < total:
            n = min(step, total - done)
            data = os.pread(fd, n, offset + done)
            if len(data) != n:
                if FileId.of(os.fstat(fd)) != ident:
                    raise changed(file)
                raise InputError(short, "the source is truncated: restore it or export it again")
            done += n
            if target_dtype and target_dtype != src_dtype and src_bits >= 8:
                yield convert_bytes(data, src_dtype, target_dtype)
            else:
                yield data
        if FileId.of(os.fstat(fd)) != ident:
            raise changed(file)
    finally:
        os.close(fd)
