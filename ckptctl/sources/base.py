"""Source protocol and the dispatcher that opens the right source for a path."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ckptctl.errors import InputError
from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import SpecFields, TensorSpec

CHUNK_BYTES = 16 * 1024 * 1024  # what one read/convert step holds in memory at most


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
    # Where each listed tensor came from (a file name), for the one duplicate check: :meth:`claim`.
    _origins: dict[str, str] = field(default_factory=dict, repr=False)

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
                chunk_bytes: int, short: str) -> Iterator[bytes]:
    """``total`` bytes of ``src_dtype`` elements at ``offset`` of ``file`` (converted to
    ``target_dtype`` when given), read with ``pread`` at most about ``chunk_bytes`` at a time.
    ``short`` is the message when the file ends first. Raises InputError."""
    from ckptctl.errors import from_oserror

    src_bits = dt.BY_NAME[src_dtype].bits
    # Keep chunks on element boundaries so each one converts on its own.
    step = max(8, chunk_bytes - chunk_bytes % 8)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise from_oserror(exc, "cannot read source shard") from None
    try:
        done = 0
        while done < total:
            n = min(step, total - done)
            data = os.pread(fd, n, offset + done)
            if len(data) != n:
                raise InputError(short, "the source is truncated: restore it or export it again")
            done += n
            if target_dtype and target_dtype != src_dtype and src_bits >= 8:
                yield convert_bytes(data, src_dtype, target_dtype)
            else:
                yield data
    finally:
        os.close(fd)
