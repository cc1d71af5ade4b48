"""Tensor sources: what export and resave read from.

A source lists its tensors from metadata alone (name, safetensors dtype, shape) and then hands
out each tensor's bytes one bounded chunk at a time. Where a tensor's bytes sit unchanged in a
file (safetensors, ``torch.save`` archives, DCP chunks that are contiguous runs) the source also
exposes that byte range (or the pieces of it) so the writer can let the kernel copy it
(``copy_file_range``); torch is
imported only by sources that need it (pickles, DCP, in-memory state dicts) or for a dtype
conversion.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHUNK_BYTES", "Source", "SourceTensor", "open_source"]


def __getattr__(name: str) -> Any:
    """The package's names, imported when first asked for: ``ckptctl.sources.kinds`` (what the
    CLI's options and every probe import) loads no reader and no base class."""
    if name == "open_source":
        from ckptctl.sources.opener import open_source

        return open_source
    if name in __all__:
        from ckptctl.sources import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
