"""Opening whatever a path holds as a tensor source: the family ``layout`` chooses, read by the
source of its container (safetensors, torch pickle, DCP)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckptctl.errors import InputError
from ckptctl.sources.base import Source

if TYPE_CHECKING:
    from ckptctl.layout.reading import MetadataReading


def open_source(path: str | os.PathLike[str], *, key: str | None = None, only: str | None = None,
                reading: "MetadataReading | None" = None) -> Source:
    """Open whatever ``path`` holds as a tensor source: the family ``layout`` chooses (``only``
    names a kind), refused when the layout has an error finding (except for DCP, whose own
    checks are stricter). A directory's copied extras (config, tokenizer, ...) come along.
    ``reading``: the command's metadata reading (``layout.reading``), when it has one."""
    from ckptctl import layout as L

    p = Path(path)
    if only in (None, "zero"):  # a DeepSpeed ZeRO root (``latest``) or step folder: its fp32 master weights
        from ckptctl.sources.zero_source import open_zero

        zero = open_zero(p, key)
        if zero is not None:
            return zero
    from ckptctl.sources.dcp_hf import open_dcp_hf  # torch's HuggingFaceStorageWriter sharded/ output

    hf = open_dcp_hf(p, only=only, key=key, reading=reading)
    if hf is not None:
        return hf
    lay = L.scan(p, reading=reading)
    fam = L.choose(lay, prefer=only)
    errors = [f for f in lay.findings if f.severity == "error"
              and not (only and f.code == "layout.two_families")]  # --only resolves that one
    if errors and fam.kind != L.DCP:
        first = errors[0]
        raise InputError(f"source is ambiguous or damaged: {first.message}",
                         first.hint or f"run `ckptctl verify {p}`")
    extras = [lay.root / n for n in lay.extras if n in L.COPIED_EXTRAS] if lay.single_file is None else []
    if fam.container == L.SAFETENSORS:
        from ckptctl.sources.safetensors_source import SafetensorsSource

        src: Source = SafetensorsSource.open(lay.root, fam.files, kind=fam.kind,
                                             fast=lay.reading.fast)
    elif fam.container == L.PYTORCH:
        from ckptctl.sources.torch_source import TorchSource

        src = TorchSource.open(lay.root, fam.files, kind=fam.kind, key=key)
    elif fam.container == L.DCP:
        from ckptctl.sources.dcp_source import DcpSource

        src = DcpSource.open(lay.root, key=key)
    else:  # pragma: no cover - layout only produces the three containers above
        raise InputError(f"unsupported source {p}", "pass a safetensors, .bin/.pt or DCP checkpoint")
    src.extras = extras
    src.is_adapter = fam.kind == L.PEFT
    src.stem, src.variant = L.safetensors_stem(fam.stem), fam.variant
    return src
