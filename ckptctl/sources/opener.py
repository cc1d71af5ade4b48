"""Opening whatever a path holds as a tensor source: the family ``layout`` chooses, read by the
source of its container (safetensors, torch pickle, DCP)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckptctl.errors import InputError, UsageError
from ckptctl.sources.base import Source

MEGATRON, DCP_HF = "megatron", "dcp-hf"  # kinds --only names beside layout's

if TYPE_CHECKING:
    from ckptctl.layout.reading import MetadataReading


def open_source(path: str | os.PathLike[str], *, key: str | None = None, only: str | None = None,
                reading: "MetadataReading | None" = None, names: str | None = None) -> Source:
    """Open whatever ``path`` holds as a tensor source: the family ``layout`` chooses (``only``
    names a kind), refused when the layout has an error finding (except for DCP, whose own
    checks are stricter). A directory's copied extras (config, tokenizer, ...) come along.
    ``reading``: the command's metadata reading (``layout.reading``), when it has one. ``names``:
    ``megatron`` exports a Megatron checkpoint under its own names (``--names megatron``)."""
    from ckptctl import layout as L

    p = Path(path)
    if only in (None, MEGATRON):  # a Megatron-core torch_dist save (root or iter_N folder)
        from ckptctl.sources.megatron.source import open_megatron

        mega = open_megatron(p, key=key, names=names == MEGATRON)
        if mega is not None:
            return mega
        if only is not None or names == MEGATRON:
            raise UsageError(f"{p} is not a Megatron-core torch_dist checkpoint",
                             "pass its --save directory (with latest_checkpointed_iteration.txt) or an iter_N folder")
    if only in (None, "zero"):  # a DeepSpeed ZeRO root (``latest``) or step folder: its fp32 master weights
        from ckptctl.sources.zero.source import open_zero

        zero = open_zero(p, key)
        if zero is not None:
            return zero
        if only is not None:
            raise UsageError(f"{p} is not a DeepSpeed ZeRO checkpoint",
                             "pass its root (with latest) or a global_stepN folder")
    from ckptctl.sources.dcp.hf import open_dcp_hf  # torch's HuggingFaceStorageWriter sharded/ output

    if only == DCP_HF:
        return _open_dcp_hf_only(p, key, reading)

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
        from ckptctl.sources.dcp.source import DcpSource

        src = DcpSource.open(lay.root, key=key)
    else:  # pragma: no cover - layout only produces the three containers above
        raise InputError(f"unsupported source {p}", "pass a safetensors, .bin/.pt or DCP checkpoint")
    src.extras = extras
    src.is_adapter = fam.kind == L.PEFT
    src.stem, src.variant = L.safetensors_stem(fam.stem), fam.variant
    return src


def _open_dcp_hf_only(p: Path, key: str | None, reading: "MetadataReading | None") -> Source:
    """``--only dcp-hf``: the DCP-HF ``sharded/`` save at ``p`` (even beside complete consolidated
    files), or a usage error when there is none."""
    from ckptctl import layout as L
    from ckptctl.sources.dcp.hf import DcpHfSource, find_sharded

    found = find_sharded(p)
    if found is None:
        raise UsageError(f"{p} holds no DCP-HF shards (torch's HuggingFaceStorageWriter sharded/ output)",
                         "drop --only dcp-hf, or pass the directory that holds sharded/")
    is_root, d = found
    src = DcpHfSource.open(d, reading=reading, key=key)
    if is_root:
        src.extras = [p / n for n in L.scan(p, reading=reading).extras if n in L.COPIED_EXTRAS]
    return src
