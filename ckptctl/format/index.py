"""The ``*.safetensors.index.json`` file: read (with findings) and encode (Hugging Face format)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ckptctl.errors import from_oserror
from ckptctl.findings import ERROR, Finding, has_errors
from ckptctl.format.header import DuplicateKey, no_duplicate_keys

MAX_INDEX_SIZE = 10 * 1024 * 1024  # huggingface_hub's MAX_INDEX_FILE_SIZE


@dataclass
class Index:
    path: str
    weight_map: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def add(self, code: str, message: str, *, severity: str = ERROR, hint: str | None = None,
            tensor: str | None = None, **details: Any) -> None:
        self.findings.append(Finding(code, severity, self.path, message, hint, tensor, dict(details)))


_REBUILD = "run `ckptctl resave --repair DIR` to rebuild the index from the shard headers"


# The last index document parsed, with the bytes it was parsed from. One command scans the same
# directory several times (layout, the export job, a repair's choice and its no-op test): each
# read compares the bytes it read (never a size or a time stamp) and parses only when they differ.
# One slot: at most one index (10 MiB) stays parsed. The object is never handed out: the Index
# holds copies of its weight_map and metadata.
_last_parsed: tuple[bytes, Any] | None = None


def read_index(path: str | os.PathLike[str], *, display: str | None = None) -> Index:
    p = os.fspath(path)
    idx = Index(path=display or p)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_INDEX_SIZE:
                idx.add("index.too_large", f"{idx.path}: index is {size} bytes, over huggingface_hub's 10 MiB limit",
                        hint="this is not an index file")
                return idx
            raw = f.read()
    except OSError as exc:
        raise from_oserror(exc, "cannot read index") from None
    global _last_parsed
    last = _last_parsed
    try:
        if last is not None and last[0] == raw:  # the same bytes: the same JSON object (only read below)
            obj = last[1]
        else:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
            _last_parsed = (raw, obj)
    except DuplicateKey as exc:
        idx.add("index.duplicate_key", f"{idx.path}: key {exc.key!r} appears twice", hint=_REBUILD,
                tensor=exc.key)
        return idx
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, an int over 4300 digits
        idx.add("index.bad_json", f"{idx.path}: not valid JSON ({exc.__class__.__name__})", hint=_REBUILD)
        return idx
    if not isinstance(obj, dict):
        idx.add("index.bad_schema", f"{idx.path}: top level is not a JSON object", hint=_REBUILD)
        return idx
    wm = obj.get("weight_map")
    # json.loads makes every key a str and every string value an exact str: a C-level pass over the types
    if not isinstance(wm, dict) or not set(map(type, wm.values())) <= {str}:
        idx.add("index.bad_schema", f"{idx.path}: 'weight_map' is missing or does not map strings to strings",
                hint=_REBUILD)
        return idx
    idx.weight_map = dict(wm)
    meta = obj.get("metadata")
    if meta is None:
        idx.add("index.no_metadata", f"{idx.path}: no 'metadata' object (transformers raises KeyError)",
                hint=_REBUILD)
    elif not isinstance(meta, dict):
        idx.add("index.bad_schema", f"{idx.path}: 'metadata' is not an object", hint=_REBUILD)
    else:
        idx.metadata = dict(meta)
    return idx


def encode_index(weight_map: dict[str, str], total_size: int, *, total_parameters: int | None = None,
                 extra_metadata: dict[str, str] | None = None) -> bytes:
    """The index as transformers writes it: sorted keys, indent 2, trailing newline."""
    metadata: dict[str, Any] = dict(extra_metadata or {})
    metadata["total_size"] = int(total_size)
    if total_parameters is not None:
        metadata["total_parameters"] = int(total_parameters)
    doc = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
