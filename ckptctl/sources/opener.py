"""Opening whatever a path holds as a tensor source: the family ``layout`` chooses, read by the
source of its container (safetensors, torch pickle, DCP)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckptctl.errors import InputError, UsageError
from ckptctl.sources.base import Source

MEGATRON = "megatron"  # --names megatron reads this kind

if TYPE_CHECKING:
    from ckptctl.layout.reading import MetadataReading


def open_source(path: str | os.PathLike[str], *, key: str | None = None, only: str | None = None,
                reading: "MetadataReading | None" = None, names: str | None = None, **options: object) -> Source:
    """Open whatever ``path`` holds as a tensor source, complete as returned: the located kind
    ``sources/kinds.locate`` finds (Megatron, ZeRO, DCP-HF), else the family ``layout`` chooses
    (:func:`open_family`). ``only`` names a kind (or a layout shape, ``index``/``single``).
    ``reading``: the command's metadata reading (``layout.reading``), when it has one. ``names``:
    ``megatron`` exports a Megatron checkpoint under its own names (``--names megatron``).
    ``options``: a kind's own options (``vocab_size``: Megatron's ``--vocab-size``), refused for
    any other kind."""
    from ckptctl.sources import kinds

    p = Path(path)
    found = kinds.locate(p, only=only if only is not None or names != MEGATRON else MEGATRON)
    if found is not None:
        if options and found.kind.name != MEGATRON:
            raise UsageError(f"--{next(iter(options)).replace('_', '-')} applies to a Megatron checkpoint; "
                             f"{p} is a {found.kind.name} one", "drop the option")
        src = found.kind.hook("open")(found.location, p, key=key, only=only, reading=reading, names=names,
                                      **options)
        if src is not None:  # None: DCP-HF beside the same consolidated files, which the layout reads
            return src
    if options:
        raise UsageError(f"--{next(iter(options)).replace('_', '-')} applies to a Megatron checkpoint; {p} is not one",
                         "drop the option")
    return open_family(p, key=key, only=only, reading=reading)


def open_family(path: Path, *, key: str | None = None, only: str | None = None,
                reading: "MetadataReading | None" = None, **_: object) -> Source:
    """The family ``layout`` chooses at ``path`` (``only`` names a kind or a shape), refused when
    the layout has an error finding (except for DCP, whose own checks are stricter), read by the
    source of its container; a directory's copied extras (config, tokenizer, ...) come along."""
    from ckptctl import layout as L

    p = Path(path)
    lay = L.scan(p, reading=reading)
    fam = L.choose(lay, prefer=only)
    errors = [f for f in lay.findings if f.severity == "error"
              and not (only and f.code == "layout.two_families")]  # --only resolves that one
    if errors and fam.kind != L.DCP:
        first = errors[0]
        raise InputError(f"source is ambiguous or damaged: {first.message}",
                         first.hint or f"run `ckptctl verify {p}`")
    extras = [lay.root / n for n in lay.extras if n in L.COPIED_EXTRAS] if lay.single_file is None else []
    stem = L.safetensors_stem(fam.stem)
    adapter = fam.kind == L.PEFT
    if fam.container == L.SAFETENSORS:
        from ckptctl.sources.safetensors_source import SafetensorsSource

        return SafetensorsSource.open(lay.root, fam.files, kind=fam.kind, reading=lay.reading, extras=extras,
                                      is_adapter=adapter, stem=stem, variant=fam.variant)
    if fam.container == L.PYTORCH:
        from ckptctl.sources.torch_source import TorchSource

        return TorchSource.open(lay.root, fam.files, kind=fam.kind, key=key, extras=extras, is_adapter=adapter,
                                stem=stem, variant=fam.variant)
    if fam.container == L.DCP:
        from ckptctl.sources.dcp.source import DcpSource

        return DcpSource.open(lay.root, key=key, extras=extras, stem=stem, variant=fam.variant)
    raise InputError(f"unsupported source {p}", "pass a safetensors, .bin/.pt or DCP checkpoint")  # pragma: no cover
