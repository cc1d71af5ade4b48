"""Source protocol and the dispatcher that opens the right source for a path."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ckptctl.errors import InputError
from ckptctl.format import dtypes as dt

CHUNK_BYTES = 16 * 1024 * 1024  # what one read/convert step holds in memory at most


@dataclass
class SourceTensor:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    # Where the bytes already sit, when they can be copied as they are (safetensors sources).
    file: str | None = None
    offset: int | None = None  # absolute offset in ``file``

    @property
    def nbytes(self) -> int:
        return dt.nbytes(dt.BY_NAME[self.dtype], self.shape)

    @property
    def numel(self) -> int:
        return dt.numel(self.shape)


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


def open_source(path: str | os.PathLike[str], *, key: str | None = None, only: str | None = None,
                allow_pickle: bool = True) -> Source:
    """Open whatever ``path`` holds as a tensor source."""
    from ckptctl import layout as L

    p = Path(path)
    lay = L.scan(p)
    fam = lay.primary(only)
    errors = [f for f in lay.findings if f.severity == "error"
              and not (only and f.code == "layout.two_families")]  # --only resolves that one
    if errors and fam.kind != L.DCP:
        first = errors[0]
        raise InputError(f"source is ambiguous or damaged: {first.message}",
                         first.hint or f"run `ckptctl verify {p}`")
    extras = [lay.root / n for n in lay.extras if n in L.COPIED_EXTRAS] if lay.single_file is None else []
    if fam.container == L.SAFETENSORS:
        from ckptctl.sources.safetensors_source import SafetensorsSource

        src: Source = SafetensorsSource.open(lay.root, fam.files, kind=fam.kind)
    elif fam.container == L.PYTORCH:
        if not allow_pickle:
            raise InputError(f"{p} is a pickle checkpoint", "pickle sources are not allowed here")
        from ckptctl.sources.torch_source import TorchSource

        src = TorchSource.open(lay.root, fam.files, kind=fam.kind, key=key)
    elif fam.container == L.DCP:
        from ckptctl.sources.dcp_source import DcpSource

        src = DcpSource.open(lay.root, key=key)
    else:  # pragma: no cover - layout only produces the three containers above
        raise InputError(f"unsupported source {p}", "pass a safetensors, .bin/.pt or DCP checkpoint")
    src.extras = extras
    src.is_adapter = fam.kind == L.PEFT
    return src
