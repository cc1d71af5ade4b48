"""The small files written beside the weights (config.json, tokenizer files, adapter_config.json).

They are read into memory (they are small; :mod:`ckptctl.format.small` bounds the read and never
blocks on a FIFO or reads a device) when the job is planned; config.json's
``dtype``/``torch_dtype`` follow the stored dtype when ``--dtype`` converted tensors. A config.json
holding a number that is not finite (``NaN``, ``Infinity``: a Megatron ``rotary_base`` of infinity)
is refused before anything is written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from ckptctl.errors import InputError, from_oserror
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
        if name == N.CONFIG:
            refuse_non_finite(blob, src)
        out[name] = blob
    return out


def _non_finite(obj: Any, path: str) -> tuple[str, float] | None:
    """The first value of ``obj`` that is a float but not a finite number (its path), or None."""
    stack = [(obj, path)]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, float) and not math.isfinite(obj):
            return path, obj
        if isinstance(obj, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(list(obj.items())))
        elif isinstance(obj, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(obj))))
    return None


def refuse_non_finite(raw: bytes, src: Path | bytes) -> None:
    """Raise InputError when config.json ``raw`` holds a number that is not finite (``NaN``,
    ``Infinity``, or a literal past the float range such as ``1e999``): JSON has no such value,
    and a model built from it (a ``rope_theta`` of infinity) computes nothing useful. ``src``:
    the file it was copied from, or bytes the source made (Megatron's arguments)."""
    try:
        cfg = small.loads(raw)
    except ValueError:
        return  # not JSON: carried as it is (verify reports it)
    found = _non_finite(cfg, "")
    if found is None:
        return
    key, value = found
    if isinstance(src, Path):
        raise InputError(f"{src}: {key} is {value}, not a finite number; the export would write it to config.json",
                         "set a finite value in the source's config.json (JSON has no NaN or Infinity)")
    raise InputError(f"the config.json made from the source would hold {key} = {value}, not a finite number",
                     "the source's own settings give it (Megatron's arguments: rotary_base, norm epsilon ...): "
                     "fix them, or give the model's config.json with --config")


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
