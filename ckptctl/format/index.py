"""The ``*.safetensors.index.json`` file: read (with findings) and encode (Hugging Face format)."""

from __future__ import annotations

import json
import operator
import os
import stat
from collections.abc import Collection, Iterable, Iterator
from itertools import repeat
from typing import Any, Callable

from ckptctl.errors import from_oserror
from ckptctl.findings import ERROR, Finding, has_errors
from ckptctl.format.header import DuplicateKey, no_duplicate_keys
from ckptctl.format.table import TensorTable, table_of

MAX_INDEX_SIZE = 10 * 1024 * 1024  # huggingface_hub's MAX_INDEX_FILE_SIZE


class Index:
    """An index as read: its findings, metadata, the shards it names, and its ``weight_map``.

    ``shards`` is computed once (sorted). A copy made by :meth:`copy` (what a
    :class:`ckptctl.layout.reading.MetadataReading` hands out for a second read of the same bytes)
    makes its own ``weight_map`` from the original's the first time someone asks for it, and
    shares the original's :meth:`agrees` and :meth:`name_facts`.

    An index a worker parsed (:meth:`from_worker`) holds, instead of its map, each shard's names
    sorted and joined by newlines, and its bytes: :meth:`agrees` reads the names, and the map is parsed
    from the bytes, in this process, only when someone asks for it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.findings: list[Finding] = []
        self.shards: list[str] = []
        self._map: dict[str, str] | None = {}
        self._source: Index | None = None  # the reading this one copies (its map, on first use)
        # a worker's reading: each shard's names, counted, and sorted and joined by newlines; and
        # the bytes (and whether the fast reader may read them) that the map is parsed from on first use
        self._joins: dict[str, tuple[int, str]] | None = None
        # for it, the header tables (read-only) already found to hold exactly a shard's names: a
        # repair asks of the same tables twice, for its plan and for its verify
        self._agreeing: dict[str, TensorTable] = {}
        self._unparsed: tuple[bytes, bool] | None = None
        self._facts: dict[str, Any] | None = None  # what a worker's names work drew from the names
        self._facts_job: Any = None  # the worker that hands it back (next), until it is taken

    @classmethod
    def from_worker(cls, path: str, raw: bytes, fast: bool, read: dict[str, Any], facts: Any = None) -> "Index":
        """The index at ``path`` as a worker read its bytes ``raw`` (:func:`worker_reading`);
        ``facts``: the worker's job (``ckptctl.worker.Job``) whose next value is its names work's
        result, taken by :meth:`name_facts` when it is first asked for."""
        out = cls(path)
        out.findings, out.metadata, out.shards = read["findings"], read["metadata"], read["shards"]
        out._joins, out._facts_job = read["joins"], facts
        out._map, out._unparsed = None, (raw, fast)
        return out

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)

    @property
    def weight_map(self) -> dict[str, str]:
        if self._map is None:
            self._map = dict(self._source.weight_map) if self._source is not None else self._parsed()
        return self._map

    @property
    def shared_map(self) -> dict[str, str]:
        """The ``weight_map`` as parsed, shared with every copy of the same reading (no copy of
        92k entries for a caller that only reads it): read it, never change it."""
        if self._map is not None:
            return self._map
        if self._source is not None:
            return self._source.shared_map
        self._map = self._parsed()
        return self._map

    def _parsed(self) -> dict[str, str]:
        """A worker's reading's map, parsed from its bytes here (the same bytes, the same reader)."""
        assert self._unparsed is not None
        raw, fast = self._unparsed
        again = Index(self.path)
        parse_index(again, raw, fast=fast)
        assert again._map is not None and again.shards == self.shards, "the bytes the worker read"
        self._unparsed = None
        return again._map

    def parsed_map(self) -> dict[str, str] | None:
        """The map if it is at hand (parsed here, or by the reading this one copies); None for a
        worker's reading nobody has asked for the map yet."""
        if self._source is not None:
            return self._source.parsed_map()
        return self._map

    def agrees(self, held: dict[str, Collection[str]], *, whole: bool) -> bool:
        """Whether the index maps to each shard of ``held`` exactly the names it holds (each
        shard's names distinct); with ``whole``, also no name to any other shard. Without the
        map (a worker's reading), from each shard's names sorted and joined (no set, no dict of
        every name): a shard's names, as distinct, sorted and joined the same way, are the same
        text only if they are the same names (a name holding a newline would add one)."""
        if self._source is not None:
            return self._source.agrees(held, whole=whole)
        count = sum(map(len, held.values()))
        if self._joins is not None:
            joins, agreeing = self._joins, self._agreeing
            for shard, names in held.items():
                joined = joins.get(shard)
                if joined is None:
                    if names:
                        return False
                    continue
                table = table_of(names)
                if table is not None and agreeing.get(shard) is table:
                    continue
                # as many names as the index maps there (none holds a newline: the worker counted
                # its own), and the same ones
                if len(names) != joined[0] or "\n".join(sorted(names)) != joined[1]:
                    return False
                if table is not None:
                    agreeing[shard] = table
            return not whole or all(map(held.__contains__, joins))
        wm = self.shared_map
        get = wm.get
        for shard, names in held.items():
            if not all(map(operator.eq, map(get, names), repeat(shard))):
                return False
        # no other name is mapped to these shards: as many entries there as names held
        return len(wm) == count if whole else sum(map(held.__contains__, wm.values())) == count

    def name_facts(self) -> dict[str, Any] | None:
        """What the reading's names work (:class:`~ckptctl.layout.reading.MetadataReading`
        ``names_work``) drew from this index's names in a worker; None when no worker ran it (the
        caller then works it out itself)."""
        if self._source is not None:
            return self._source.name_facts()
        job, self._facts_job = self._facts_job, None
        if job is not None:
            from ckptctl.worker import WorkerFailed

            try:
                self._facts = job.next()
            except WorkerFailed:
                self._facts = None
            job.done()
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


def read_index_bytes(p: str, idx: Index, *, same_as: Iterable[bytes] = ()) -> bytes | None:
    """The file's bytes (bounded); None, with a finding on ``idx``, when it is not a regular file
    or is too large. ``same_as``: bytes read before; where the file holds exactly one of them,
    that very object is returned, the file compared with it piece by piece rather than read into
    a second copy (an index of 9 MB is 2,200 fresh pages, about 6 ms here)."""
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
            same = _same_bytes(f, [b for b in same_as if len(b) == size])
            if same is not None:
                return same
            f.seek(0)
            raw = f.read(MAX_INDEX_SIZE + 1)  # bounded: the file may grow after fstat
    except OSError as exc:
        raise from_oserror(exc, "cannot read index") from None
    if len(raw) > MAX_INDEX_SIZE:
        idx.add("index.too_large", f"{idx.path}: index is over huggingface_hub's 10 MiB limit",
                hint="this is not an index file")
        return None
    return raw


_PIECE = 1 << 16  # compared a piece at a time: one buffer, reused, from the heap


def _same_bytes(f: Any, candidates: list[bytes]) -> bytes | None:
    """The one of ``candidates`` (each of the file's size) that the open file ``f`` holds from
    its start to its end, compared piece by piece; None when none does."""
    if not candidates:
        return None
    buf = bytearray(_PIECE)
    view = memoryview(buf)
    at = 0
    while candidates:
        got = f.readinto(buf)
        if not got:
            break
        piece = view[:got]
        candidates = [c for c in candidates if c.startswith(piece, at)]
        at += got
    return next((c for c in candidates if len(c) == at), None)


def parse_index(idx: Index, raw: bytes, *, fast: bool = True, shards: tuple[str, ...] = ()) -> None:
    """Parse ``raw`` into ``idx``: ``json`` with :func:`no_duplicate_keys` is the reference;
    ``fast``: msgspec reads it first wherever it provably reads the same
    (:func:`ckptctl.format.index_fast.load`, imported only then; ``shards``: the names its
    shards probably have, for its values)."""
    try:
        typed = None
        if fast:
            from ckptctl.format import index_fast

            typed = index_fast.load(raw, shards)
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


def worker_reading(raw: bytes, path: str, fast: bool, names_work: Callable[[Any], Any] | None,
                   joins: bool = True, shards: tuple[str, ...] = ()) -> Iterator[dict[str, Any] | Any]:
    """What a worker hands back, in turn (``ckptctl.worker``: each as soon as it is made): for
    :meth:`Index.from_worker`, the index ``raw`` parsed as :func:`parse_index` parses it (its
    findings, metadata and shards; ``shards``: the names they probably have) with each shard's
    names counted, and sorted and joined by newlines (None where a name holds one, or without ``joins``: the
    map is then parsed where it is needed); then, with ``names_work``, its result on the names
    (None for an index with an error)."""
    idx = Index(path)
    parse_index(idx, raw, fast=fast, shards=shards)
    joined: dict[str, tuple[int, str]] | None = None
    if joins and idx.ok and idx._map is not None:
        groups: dict[str, list[str]] = {}
        for name, shard in idx._map.items():
            groups.setdefault(shard, []).append(name)
        joined = {shard: (len(names), "\n".join(sorted(names))) for shard, names in groups.items()}
        if any(text.count("\n") != count - 1 for count, text in joined.values()):
            joined = None
    yield {"findings": idx.findings, "metadata": idx.metadata, "shards": idx.shards, "joins": joined}
    if names_work is not None:
        yield names_work(idx._map) if idx.ok and idx._map is not None else None


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
