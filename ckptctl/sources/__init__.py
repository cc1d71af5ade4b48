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

from ckptctl.sources.base import CHUNK_BYTES, Source, SourceTensor
from ckptctl.sources.opener import open_source

__all__ = ["CHUNK_BYTES", "Source", "SourceTensor", "open_source"]
