"""The ``*.safetensors.index.json`` file: read (with findings) and encode (Hugging Face format)."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from ckptctl.errors import from_oserror
from ckptctl.findings import ERROR, Finding, has_errors
from ckptctl.format.header import DuplicateKey, no_duplicate_keys

MAX_INDEX_SIZE = 10 * 1024 * 1024  # huggingface_hub's MAX_INDEX_FILE_SIZE


class Index:
    """An index as read: its findings, metadata, the shards it names, and its ``weight_map``.

    ``shards`` is computed once (sorted). A copy made by :meth:`copy` (what a
    :class:`ckptctl.layout.reading.MetadataReading` hands out for a second read of the same bytes)
    makes its own ``weight_map`` from the original's the first time someone asks for it, and
    shares the original's :meth:`name_facts`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.findings: list[Finding] = []
        self.shards: list[str] = []
        self._map: dict[str, str] | None = {}
        self._source: Index | None = None  # the reading this one copies (its map, on first use)
        # the names work a reading started on this index's names (a ckptctl.worker.Job, kept until
        # this index goes: a worker that delivered is reaped then, never waited for), its result
        self.names_job: Any = None
        self._facts: dict[str, Any] | None = None
        self._facts_taken = False

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)

    @property
    def weight_map(self) -> dict[str, str]:
        if self._map is None:
            assert self._source is not None
            self._map = dict(self._source.weight_map)
        return self._map

    @property
    def shared_map(self) -> dict[str, str]:
        """The ``weight_map`` as parsed, shared with every copy of the same reading (no copy of
        92k entries for a caller that only reads it): read it, never change it."""
        if self._map is not None:
            return self._map
        assert self._source is not None
        return self._source.shared_map

    def name_facts(self) -> dict[str, Any] | None:
        """What the reading's names work drew from this index's names
        (:class:`~ckptctl.layout.reading.MetadataReading` ``names_work``), taken from its worker on
        the first call; None when none was started or the worker failed (the caller then works
        it out itself)."""
        if self._source is not None:
            return self._source.name_facts()
        if self.names_job is not None and not self._facts_taken:
            from ckptctl.worker import WorkerFailed

            self._facts_taken = True
            try:
                self._facts = self.names_job.result()
            except WorkerFailed:
                self._facts = None
        return self._facts

    def add(self, code: str, message: str, *, severity: str = ERROR, hint: str | None = None,
            tensor: str | None = None, **details: Any) -> None:
        self.findings.append(Finding(code, severity, self.path, message, hint, tensor, dict(details)))

    def copy(self, path: str | None = None) -> "Index":
        """An Index of the same reading that shares nothing mutable with this one, shown as
        ``path`` (only an index without findings may be shown at another path: they name it)."""
        shown = self.path if path is None else path
        assert shown == self.path or not self.findings, "an index's findings name its path"
        out = Index(shown)
        out.metadata, out.findings, out.shards = dict(self.metadata), list(self.findings), list(self.shards)
        out._map, out._source = None, self
        return out


_REBUILD = "run `ckptctl resave --repair DIR` to rebuild the index from the shard headers"


def read_index(path: str | os.PathLike[str], *, display: str | None = None, fast: bool = True) -> Index:
    """Read and check an index file (never raises for its content: every problem is a finding;
    :class:`CkptctlError` only when it cannot be read at all). ``fast``: msgspec may parse it
    (:func:`parse_index`)."""
    p = os.fspath(path)
    idx = Index(display or p)
    raw = read_index_bytes(p, idx)
    if raw is not None:
        parse_index(idx, raw, fast=fast)
    return idx


def read_index_bytes(p: str, idx: Index) -> bytes | None:
    """The file's bytes (bounded); None, with a finding on ``idx``, when it is not a regular file
    or is too large."""
    try:
        # O_NONBLOCK: a FIFO put in the index's place after layout looked at it must not block
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                idx.add("index.bad_json", f"{idx.path}: not a regular file (a FIFO, device or directory)",
                        hint=_REBUILD)
                return None
            size = st.st_size
            if size > MAX_INDEX_SIZE:
                idx.add("index.too_large", f"{idx.path}: index is {size} bytes, over huggingface_hub's 10 MiB limit",
                        hint="this is not an index file")
                return None
            raw = f.read(MAX_INDEX_SIZE + 1)  # bounded: the file may grow after fstat
    except OSError as exc:
        raise from_oserror(exc, "cannot read index") from None
    if len(raw) > MAX_INDEX_SIZE:
        idx.add("index.too_large", f"{idx.path}: index is over huggingface_hub's 10 MiB limit",
                hint="this is not an index file")
        return None
    return raw


def parse_index(idx: Index, raw: bytes, *, fast: bool = True) -> None:
    """Parse ``raw`` into ``idx``: ``json`` with :func:`no_duplicate_keys` is the reference;
    ``fast``: msgspec reads it first wherever it provably reads the same
    (:func:`ckptctl.format.index_fast.load`, imported only then)."""
    try:
        typed = None
        if fast:
            from ckptctl.format import index_fast

            typed = index_fast.load(raw)
        obj = typed if typed is not None else json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:
        idx.add("index.duplicate_key", f"{idx.path}: key {exc.key!r} appears twice", hint=_REBUILD,
                tensor=exc.key)
        return
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, an int over 4300 digits
        idx.add("index.bad_json", f"{idx.path}: not valid JSON ({exc.__class__.__name__})", hint=_REBUILD)
        return
    if not isinstance(obj, dict):
        idx.add("index.bad_schema", f"{idx.path}: top level is not a JSON object", hint=_REBUILD)
        return
    wm = obj.get("weight_map")
    # json.loads makes every key a str and every string value an exact str: a C-level pass over the
    # types (msgspec's record holds only strings: nothing to check)
    if not isinstance(wm, dict) or (obj is not typed and not set(map(type, wm.values())) <= {str}):
        idx.add("index.bad_schema", f"{idx.path}: 'weight_map' is missing or does not map strings to strings",
                hint=_REBUILD)
        return
    idx._map = wm
    idx.shards = sorted(set(wm.values()))
    _metadata(idx, obj)


def _metadata(idx: Index, obj: dict[str, Any]) -> None:
    meta = obj.get("metadata")
    if meta is None:
        idx.add("index.no_metadata", f"{idx.path}: no 'metadata' object (transformers raises KeyError)",
                hint=_REBUILD)
    elif not isinstance(meta, dict):
        idx.add("index.bad_schema", f"{idx.path}: 'metadata' is not an object", hint=_REBUILD)
    else:
        idx.metadata = meta


def encode_index(weight_map: dict[str, str], total_size: int, *, total_parameters: int | None = None,
                 extra_metadata: dict[str, str] | None = None) -> bytes:
    """The index as transformers writes it: sorted keys, indent 2, trailing newline."""
    metadata: dict[str, Any] = dict(extra_metadata or {})
    metadata["total_size"] = int(total_size)
    if total_parameters is not None:
        metadata["total_parameters"] = int(total_parameters)
    doc = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
