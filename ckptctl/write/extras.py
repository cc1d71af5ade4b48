"""The small files written beside the weights (config.json, tokenizer files, adapter_config.json).

They are read into memory (they are small; :mod:`ckptctl.format.small` bounds the read and never
blocks on a FIFO or reads a device) when the job is planned; config.json's
``dtype``/``torch_dtype`` follow the stored dtype when ``--dtype`` converted tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ckptctl.errors import from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.write.inputs import Entry

EXTRA_LIMIT = 1 << 30  # bytes: the largest tokenizer/processor file we carry (real ones are < 40 MB)


def read_extras(extras: dict[str, Path | bytes], entries: list[Entry]) -> dict[str, bytes]:
    """Every extra as bytes (name -> content), config.json's dtype synced to the entries'."""
    out: dict[str, bytes] = {}
    converted = any(e.converted for e in entries)
    stored = dominant_float(entries) if converted else None
    for name, src in extras.items():
        if isinstance(src, bytes):
            blob = src
        else:
            try:
                blob = small.read_small(src, limit=EXTRA_LIMIT, follow=True)  # a cache snapshot links
            except OSError as exc:
                raise from_oserror(exc, f"cannot read {name}", phase="plan") from None
        if name == N.CONFIG and stored:
            blob = sync_config_dtype(blob, stored)
        out[name] = blob
    return out


def dominant_float(entries: Iterable[Entry]) -> str | None:
    """The stored floating dtype that holds the most parameters, or None."""
    counts: dict[str, int] = {}
    for e in entries:
        if e.dtype in dt.CONVERTIBLE:
            counts[e.dtype] = counts.get(e.dtype, 0) + e.spec.numel
    return max(counts, key=lambda k: counts[k]) if counts else None


def sync_config_dtype(raw: bytes, stored: str) -> bytes:
    """config.json with its ``dtype``/``torch_dtype`` fields (top level, and each sub-config with
    a ``model_type``) set to the stored dtype; unchanged when it is not a JSON object."""
    try:
        cfg = small.loads(raw)
    except ValueError:
        return raw
    name = dt.CONFIG_NAMES.get(stored)
    if not isinstance(cfg, dict) or name is None:
        return raw
    changed = False
    for c in [cfg] + [v for v in cfg.values() if isinstance(v, dict) and "model_type" in v]:
        for key in ("dtype", "torch_dtype"):
            if key in c and c[key] != name:
                c[key] = name
                changed = True
    if not changed:
        return raw
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8")
