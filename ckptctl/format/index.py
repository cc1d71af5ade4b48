"""The ``*.safetensors.index.json`` file: read (with findings) and encode (Hugging Face format)."""

from __future__ import annotations

import json
import mmap
import os
import stat
from typing import Any, Iterable, Mapping

from ckptctl.errors import InputError, from_oserror
from ckptctl.findings import ERROR, Finding, has_errors
from ckptctl.format import index_text
from ckptctl.format.header import DuplicateKey, no_duplicate_keys
from ckptctl.format.read_ahead import Identity, identity

MAX_INDEX_SIZE = 10 * 1024 * 1024  # huggingface_hub's MAX_INDEX_FILE_SIZE


class Index:
    """An index as read: its findings, metadata, the shards it names, and its ``weight_map``.

    ``shards`` is computed once (sorted). ``joins`` (when the index was read by a worker, see
    :func:`read_for_worker`) holds each shard's tensor names, sorted and joined by newlines, so
    that the index can be checked against the shard headers without a dict of every tensor.
    ``weight_map`` is then made the first time someone asks for it, from the file read again:
    the same file (device, inode, size, mtime, ctime), or one that says the same (its joins,
    metadata and findings); anything else is the checkpoint changing under the command
    (:class:`InputError`), never a second snapshot mixed with the first."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.findings: list[Finding] = []
        self.shards: list[str] = []
        self.joins: dict[str, str] | None = None
        self._map: dict[str, str] | None = {}
        self._raw: bytes | None = None
        self._file: tuple[str, Identity] | None = None  # where a worker read it (its bytes not kept)
        self._source: Index | None = None  # the cached Index this one copies (its map, on first use)
        # (work, its result): what a split's worker drew from the names (read_ahead.NamesWork)
        self.facts: tuple[Any, Any] | None = None

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)

    @property
    def weight_map(self) -> dict[str, str]:
        if self._map is None:
            src = self._source
            if src is not None:
                self._map = dict(src.weight_map)
            elif self._raw is not None:
                self._map = _weight_map_of(self._raw)
            else:
                self._map = self._read_again()
        return self._map

    def _read_again(self) -> dict[str, str]:
        assert self._file is not None
        path, ident = self._file
        again = Index(self.path)
        got = _read_bytes(path, again)
        if got is not None:
            raw, now = got
            if now == ident:  # the file the worker read
                return _weight_map_of(raw)
            _parse(again, raw)  # rewritten since: the same only if it says the same
            if again._map:
                again.joins = _joins(again._map)
            if (again.joins, again.metadata, again.findings) == (self.joins, self.metadata, self.findings):
                return again._map or {}
        raise InputError(f"{self.path} changed while ckptctl was reading it",
                         "run the command again once nothing else writes the checkpoint")

    def add(self, code: str, message: str, *, severity: str = ERROR, hint: str | None = None,
            tensor: str | None = None, **details: Any) -> None:
        self.findings.append(Finding(code, severity, self.path, message, hint, tensor, dict(details)))

    def agrees_with(self, names_by_shard: Mapping[str, Iterable[str]]) -> bool | None:
        """Whether the index maps exactly these names to these shards (each shard it names, and
        no other), from :attr:`joins`: each shard's names sorted and joined by newlines against
        the index's own. None when it cannot tell that way (no joins, a name holding a newline):
        the caller then compares ``weight_map``. The index has no repeated key, so True also
        means that no name is in two shards."""
        joins = self.joins
        if joins is None:
            return None
        if joins.keys() != names_by_shard.keys():
            return False
        for shard, names in names_by_shard.items():
            ordered = sorted(names)
            text = "\n".join(ordered)
            if text.count("\n") != len(ordered) - 1:
                return None
            if text != joins[shard]:
                return False
        return True

    def copy(self) -> "Index":
        """An Index of the same reading that shares nothing mutable with this one."""
        out = Index(self.path)
        out.metadata, out.findings, out.shards = dict(self.metadata), list(self.findings), list(self.shards)
        out.joins = None if self.joins is None else dict(self.joins)
        out._map, out._raw, out._file, out._source = None, self._raw, self._file, self
        out.facts = self.facts  # never changed once made
        return out


_REBUILD = "run `ckptctl resave --repair DIR` to rebuild the index from the shard headers"


# The last index read, with the bytes and display it was read with. One command scans the same
# directory several times (layout, the export job, a repair's choice and its no-op test): each
# read compares the bytes it read (never a size or a time stamp) and parses only when they differ.
# One slot: at most one index (10 MiB) stays parsed. The cached Index is never handed out: each
# read gets a copy (:meth:`Index.copy`).
_last_read: tuple[bytes, str, Index] | None = None


def read_index(path: str | os.PathLike[str], *, display: str | None = None) -> Index:
    p = os.fspath(path)
    idx = Index(display or p)
    got = _read_bytes(p, idx)
    if got is None:
        return idx
    raw = got[0]
    last = _last_read
    if last is not None and last[0] == raw and last[1] == idx.path:  # the same bytes: the same reading
        return last[2].copy()
    _parse(idx, raw)
    remember(idx)
    return idx.copy()


def remember(idx: Index) -> None:
    """Make ``idx`` (a reading of its ``_raw`` bytes) the one :func:`read_index` reuses (a
    worker's reading keeps no bytes: ``layout.prefetch`` reuses those by the file's identity)."""
    global _last_read
    if idx._raw is not None:
        _last_read = (idx._raw, idx.path, idx)


def read_for_worker(path: str, display: str) -> Index:
    """:func:`read_index` as a worker process runs it for ``layout.scan``: with ``joins``, and
    neither the parsed ``weight_map`` nor the bytes (the parent reads the file again only if it
    needs the map: :attr:`Index.weight_map`).

    The file is mapped, and its joins cut from the mapping where :func:`index_text.joins_of` can
    (no copy of the bytes, no dict of the entries); else it is read and parsed as always. Only in
    a worker: a file truncated under the mapping ends the process with SIGBUS, and the worker's
    parent then reads the index itself."""
    idx = Index(display)
    mapped = _mapped(path)
    if mapped is not None:
        buf, ident = mapped
        try:
            cut = index_text.joins_of(buf)
        finally:
            buf.close()
        if cut is not None:
            doc, joins = cut
            idx.joins, idx.shards, idx._map, idx._file = joins, sorted(joins), None, (path, ident)
            _metadata(idx, doc)
            return idx
    got = _read_bytes(path, idx)
    if got is not None:
        _parse(idx, got[0])
        if idx._map:  # parsed: the parent can parse the same file again
            idx.joins = _joins(idx._map)
            idx._map = None
            idx._raw, idx._file = None, (path, got[1])
    return idx


def _mapped(p: str) -> tuple[mmap.mmap, Identity] | None:
    """A read-only private mapping of the whole file, with the identity of the file mapped; None
    for what :func:`_read_bytes` is left to judge (not a regular file, empty, too large)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= MAX_INDEX_SIZE:
            return None
        # every page at once (MAP_POPULATE): one call instead of a fault per page
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ), identity(st)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _read_bytes(p: str, idx: Index) -> tuple[bytes, Identity] | None:
    """The file's bytes and the identity of the file they were read from; None (with a finding)
    when it is not a regular file or is too large."""
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
    return raw, identity(st)


def _parse(idx: Index, raw: bytes) -> None:
    idx._raw = raw
    try:
        obj = _fast_load(raw)
        if obj is None:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
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
    # json.loads makes every key a str and every string value an exact str: a C-level pass over the types
    if not isinstance(wm, dict) or not set(map(type, wm.values())) <= {str}:
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


def _fast_load(raw: bytes) -> Any:
    """orjson's reading of an index (about twice as fast as json's on 92k entries), where it is
    provably what ``json.loads`` with :func:`no_duplicate_keys` reads; None where it may not be
    (json then reads it): orjson missing or refusing it, an escape anywhere, a weight_map that is
    not strings to strings, a number 0 (orjson reads ``-0`` as 0) or a float outside it, nesting
    past 64 levels, or a key orjson dropped as a repeat. With no backslash in the text every
    ``"`` opens or closes a string, so the text holds as many strings as the reading does (each
    key and each string value) exactly when no key repeats."""
    if b"\\" in raw:
        return None
    try:
        import orjson
    except ImportError:
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    wm = obj.get("weight_map")
    if type(wm) is not dict or not set(map(type, wm.values())) <= {str}:
        return None
    strings = 0
    for key, value in obj.items():
        more = 2 * len(wm) if key == "weight_map" else _strings_in(value, 1)
        if more is None:
            return None
        strings += 1 + more
    return obj if raw.count(b'"') == 2 * strings else None


def _strings_in(value: Any, depth: int) -> int | None:
    """The strings (keys and values) in ``value``; None for what json may read otherwise."""
    if type(value) is str:
        return 1
    if value is None or type(value) is bool or (type(value) is int and value != 0):
        return 0
    if depth > 64 or type(value) not in (dict, list):
        return None  # a float, a 0 (perhaps -0), deep nesting
    total = len(value) if type(value) is dict else 0
    for item in (value.values() if type(value) is dict else value):
        got = _strings_in(item, depth + 1)
        if got is None:
            return None
        total += got
    return total


def _weight_map_of(raw: bytes) -> dict[str, str]:
    """The weight_map of bytes that were read once already (and passed every check then)."""
    obj = _fast_load(raw)
    if obj is None:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    return obj["weight_map"]  # type: ignore[no-any-return]


def _joins(wm: dict[str, str]) -> dict[str, str] | None:
    """Each shard's names, sorted and joined by newlines; None when a name holds a newline (the
    join could not tell its names apart)."""
    groups: dict[str, list[str]] = {}
    for name, shard in wm.items():
        g = groups.get(shard)
        if g is None:
            g = groups[shard] = []
        g.append(name)
    out = {}
    for shard, names in groups.items():
        names.sort()
        text = out[shard] = "\n".join(names)
        if text.count("\n") != len(names) - 1:
            return None
    return out


def encode_index(weight_map: dict[str, str], total_size: int, *, total_parameters: int | None = None,
                 extra_metadata: dict[str, str] | None = None) -> bytes:
    """The index as transformers writes it: sorted keys, indent 2, trailing newline."""
    metadata: dict[str, Any] = dict(extra_metadata or {})
    metadata["total_size"] = int(total_size)
    if total_parameters is not None:
        metadata["total_parameters"] = int(total_parameters)
    doc = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
