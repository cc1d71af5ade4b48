"""Read, validate and encode safetensors headers without torch.

Validation is at least as strict as the safetensors Rust crate (``Metadata::validate``) and adds
what the crate lets through (duplicate keys, non-space padding, a git-LFS pointer or HTML page in
place of a shard, a tensor named ``__metadata__``, unaligned offsets). Every problem is a
:class:`~ckptctl.findings.Finding` with its own code, and all problems of a file are reported.
"""

from __future__ import annotations

import json
import operator
import os
import re
import stat
import struct
from array import array
from collections import Counter
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from itertools import accumulate, chain, islice, repeat
from math import prod
from json.decoder import scanstring
from json.encoder import encode_basestring as _encode_string  # json.dumps' own, ensure_ascii=False
from typing import Any, Callable, TypeVar

from ckptctl.errors import CkptctlError, InputError, from_oserror
from ckptctl.findings import ERROR, WARNING, Finding, has_errors
from ckptctl.format import dtypes as dt
from ckptctl.format import read_ahead
from ckptctl.format.tensor import SpecFields, TensorSpec, by_columns, dtypes
from ckptctl.gcpause import paused

MAX_HEADER_SIZE = 100_000_000  # safetensors' MAX_HEADER_SIZE
HUB_MAX_HEADER_SIZE = 25_000_000  # huggingface_hub refuses larger headers in its metadata API
MAX_DIM_PRODUCT = 1 << 48  # the schema's limit on sizes
VALID_FORMATS = ("pt", "mlx")
METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorInfo(SpecFields):
    """One tensor of a safetensors file: its spec and where its bytes sit. ``begin``/``end`` are
    relative to the data section."""

    spec: TensorSpec
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


Offsets = Any  # array("Q"), or a list once an offset does not fit 64 bits (a hostile header)


_V = TypeVar("_V")


class _ByColumn(Mapping[str, _V]):
    """A read-only mapping whose views iterate by the subclass's own iterators over its columns
    (``_iter_values``, ``_iter_items``: C loops), not by a ``__getitem__`` per name as
    ``Mapping``'s views would."""

    def keys(self) -> KeysView[str]:
        return _Keys(self)

    def values(self) -> ValuesView[_V]:
        return _Values(self)

    def items(self) -> ItemsView[str, _V]:
        return _Items(self)

    def _iter_values(self) -> Iterator[_V]:
        raise NotImplementedError

    def _iter_items(self) -> Iterator[tuple[str, _V]]:
        raise NotImplementedError


class TensorTable(_ByColumn[TensorInfo]):
    """The tensors of a header by name, in data-offset order, stored by column: a dict from each
    name to its row, the begin and end offsets (``array``), and per row a code into a table of
    the (dtype, shape) pairs the tensors share. A :class:`TensorInfo` is built when it is asked
    for, so a header of a million tensors costs a compact record per tensor, never a tree of
    dicts and lists (nor a million ``TensorInfo``). Read-only."""

    def __init__(self, names: list[str], begin: Offsets, end: Offsets, kind: array[int],
                 kinds: list[tuple[str, tuple[int, ...]]]) -> None:
        self._names = names  # by row (unique)
        self._begin, self._end, self._kind, self._kinds = begin, end, kind, kinds
        self._rows: dict[str, int] | None = None  # name -> row, made by the first look-up by name
        # proven as it was read: from 0, each tensor begins where the one before ends (in order)
        self._contiguous = False

    @classmethod
    def empty(cls) -> "TensorTable":
        return cls([], array("Q"), array("Q"), array("I"), [])

    def rows(self) -> dict[str, int]:
        """Name -> row (made by the parser, or by the first look-up by name)."""
        if self._rows is None:
            self._rows = dict(zip(self._names, range(len(self._names))))
        return self._rows

    def row_of(self, name: str) -> int:
        return (self._rows if self._rows is not None else self.rows())[name]

    def __getitem__(self, name: str) -> TensorInfo:
        row = self.row_of(name)
        dtype, shape = self._kinds[self._kind[row]]
        return TensorInfo(TensorSpec(name, dtype, shape), self._begin[row], self._end[row])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        try:
            self.row_of(name)  # type: ignore[arg-type]
        except (KeyError, TypeError):  # not a name, or not a hashable one
            return False
        return True

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors)"

    def _iter_values(self) -> Iterator[TensorInfo]:
        # C loops over the columns: the records' own constructors are the only Python work
        return map(TensorInfo, self.iter_specs(), self._begin, self._end)

    def _iter_items(self) -> Iterator[tuple[str, TensorInfo]]:
        return zip(self._names, self._iter_values())

    def spec_list(self) -> list[TensorSpec]:
        """Every tensor's spec, in the table's order, made column by column (:func:`by_columns`)."""
        dtypes, shapes = [k[0] for k in self._kinds], [k[1] for k in self._kinds]
        return by_columns(TensorSpec, self._names, list(map(dtypes.__getitem__, self._kind)),
                          list(map(shapes.__getitem__, self._kind)))

    def iter_specs(self) -> Iterator[TensorSpec]:
        """Every tensor's spec, in the table's order (one C loop; no :class:`TensorInfo`)."""
        dtypes, shapes = [k[0] for k in self._kinds], [k[1] for k in self._kinds]
        return map(TensorSpec, self._names, map(dtypes.__getitem__, self._kind), map(shapes.__getitem__, self._kind))

    def specs(self) -> "SpecView":
        """The tensors' specs by name (a view, built on demand)."""
        return SpecView(self)

    # columns: what a pass over every tensor needs, without building a record per tensor
    @property
    def kinds(self) -> list[tuple[str, tuple[int, ...]]]:
        """The distinct (dtype, shape) pairs; :attr:`kind_codes` indexes them per row."""
        return self._kinds

    @property
    def kind_codes(self) -> array[int]:
        return self._kind

    @property
    def begins(self) -> Offsets:
        """Each tensor's begin offset, in the table's order (the column itself: read-only)."""
        return self._begin

    @property
    def data_bytes(self) -> int:
        return sum(self._end) - sum(self._begin)

    @property
    def data_end(self) -> int:
        """Where the last tensor in offset order ends (0 without tensors)."""
        return self._end[-1] if len(self._end) else 0

    @property
    def numel(self) -> int:
        """Elements of every tensor together."""
        return sum(prod(self._kinds[k][1]) * n for k, n in self.kind_counts().items())

    def kind_counts(self) -> Counter[int]:
        """How many tensors have each kind code (one C pass)."""
        return Counter(self._kind)

    def dtype_counts(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for k, n in self.kind_counts().items():
            out[self._kinds[k][0]] += n
        return out

    def dtype_set(self) -> set[str]:
        """The dtypes the tensors are stored in (from the kinds in use, no record per tensor)."""
        return {self._kinds[k][0] for k in set(self._kind)}


class SpecView(_ByColumn[TensorSpec]):
    """A :class:`TensorTable`'s specs by name, in its order."""

    def __init__(self, table: TensorTable) -> None:
        self._table = table

    def __getitem__(self, name: str) -> TensorSpec:
        return self._table[name].spec

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def dtype_set(self) -> set[str]:
        return self._table.dtype_set()

    def _iter_values(self) -> Iterator[TensorSpec]:
        return self._table.iter_specs()

    def _iter_items(self) -> Iterator[tuple[str, TensorSpec]]:
        return zip(self._table, self._iter_values())


class MergedSpecs(_ByColumn[TensorSpec]):
    """Several tensor mappings (the files of a family: each a header's :class:`SpecView` or a
    pickle's dict) read as one, by name; a name in more than one is the last one's, in the order
    ``dict.update`` would give. Only an index from each name to its part is built, by C loops: a
    spec is looked up in its part when asked for, so the 92k tensors of 163 headers are not made
    one spec each unless a rule reads them all."""

    def __init__(self, parts: list[Mapping[str, Any]], *, disjoint: bool | None = None) -> None:
        """``disjoint``: the caller knows that no name is in two parts (verify, from the index's
        agreement with the headers): then no index of every name is built; a look-up by name asks
        each part's own (a header's rows) in turn."""
        self._parts = parts
        self._where: dict[str, Mapping[str, Any]] | None = None
        self._disjoint = disjoint
        self._lookups: list[Mapping[str, Any]] | None = None
        if disjoint is None:
            self._index()

    def _index(self) -> dict[str, Mapping[str, Any]]:
        if self._where is None:
            where: dict[str, Mapping[str, Any]] = {}
            for part in self._parts:
                where.update(zip(part, repeat(part)))
            self._where = where
            if self._disjoint is None:
                self._disjoint = len(where) == sum(map(len, self._parts))  # no name in two parts
        return self._where

    def _part_of(self, name: str) -> Mapping[str, Any] | None:
        """The part holding ``name`` when the parts are disjoint and no index was built."""
        if self._lookups is None:
            self._lookups = [p._table.rows() if type(p) is SpecView else p for p in self._parts]
        for rows, part in zip(self._lookups, self._parts):
            if name in rows:
                return part
        return None

    @property
    def disjoint(self) -> bool:
        """No name is in two parts."""
        if self._disjoint is None:
            self._index()
        return bool(self._disjoint)

    def __getitem__(self, name: str) -> TensorSpec:
        if self._where is None and self._disjoint:
            part = self._part_of(name)
            if part is None:
                raise KeyError(name)
            return part[name]  # type: ignore[no-any-return]
        return self._index()[name][name]  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        if self._where is None and self._disjoint:
            return chain.from_iterable(self._parts)
        return iter(self._index())

    def __len__(self) -> int:
        if self._where is None and self._disjoint:
            return sum(map(len, self._parts))
        return len(self._index())

    def __contains__(self, name: object) -> bool:
        try:
            if self._where is None and self._disjoint:
                return self._part_of(name) is not None  # type: ignore[arg-type]
            return name in self._index()
        except TypeError:  # not hashable
            return False

    def dtype_set(self) -> set[str | None]:
        if self.disjoint:
            return set().union(*map(dtypes, self._parts))
        return set(map(operator.attrgetter("dtype"), self.values()))

    def _iter_values(self) -> Iterator[TensorSpec]:
        if self.disjoint:  # the merged order is each part's order in turn: no look-up by name
            return chain.from_iterable(part.values() for part in self._parts)
        return map(self.__getitem__, self._index())

    def _iter_items(self) -> Iterator[tuple[str, TensorSpec]]:
        return zip(iter(self), self._iter_values())


class _Keys(KeysView):  # type: ignore[type-arg]
    """The names, iterated by the list's own iterator (``KeysView`` yields them one by one from a
    generator: set operations on 90k names would pay a Python step each)."""

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)  # type: ignore[no-any-return]


class _Values(ValuesView):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[Any]:
        return self._mapping._iter_values()  # type: ignore[attr-defined, no-any-return]


class _Items(ItemsView):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[Any]:
        return self._mapping._iter_items()  # type: ignore[attr-defined, no-any-return]


@dataclass
class Header:
    """A parsed header. ``tensors`` is in data-offset order; ``findings`` lists every problem."""

    path: str
    file_size: int
    header_len: int = 0
    tensors: TensorTable = field(default_factory=TensorTable.empty)
    metadata: dict[str, str] | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)

    @property
    def data_bytes(self) -> int:
        return self.tensors.data_bytes

    def add(self, code: str, message: str, *, severity: str = ERROR, tensor: str | None = None,
            hint: str | None = None, **details: Any) -> None:
        self.findings.append(
            Finding(code, severity, self.path, message, hint, tensor, dict(details))
        )


class DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # one C call per object (a header has one per tensor)
    if len(out) != len(pairs):  # a key repeats: name the first repeat, as a key-by-key check meets it
        seen: set[str] = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return out


class _BadJson(Exception):
    """JSON that Python's parser accepts but serde_json (the safetensors crate) rejects."""


def _reject_constant(name: str) -> Any:
    raise _BadJson(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _BadJson(f"number out of range: {text[:40]}")
    return value


def _int_or_negative_zero(text: str) -> int | float:
    try:
        value = int(text)
    except ValueError:  # over Python's 4300-digit limit; serde_json: out of f64 range
        raise _BadJson(f"number out of range: {text[:40]}...") from None
    # serde_json reads "-0" as the float -0.0, which is not a valid size or offset.
    return -0.0 if value == 0 and text.startswith("-") else value


_STRICT = json.JSONDecoder(object_pairs_hook=no_duplicate_keys, parse_constant=_reject_constant,
                           parse_float=_finite_float, parse_int=_int_or_negative_zero)
# Python's own int() for integers: the same value wherever no number is a negative zero
_FAST = json.JSONDecoder(object_pairs_hook=no_duplicate_keys, parse_constant=_reject_constant,
                         parse_float=_finite_float)


# serde_json's default recursion limit: the 128th nested array/object is refused.
MAX_JSON_DEPTH = 127


def _serde_problem(obj: Any) -> str | None:
    """What serde_json would refuse in an already parsed document: lone surrogate escapes and
    nesting deeper than its recursion limit (both accepted by Python's json)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nesting deeper than {MAX_JSON_DEPTH} levels"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for s in (key, item):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        return f"lone surrogate escape in string {s[:40]!r}"
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
    return None


_REDOWNLOAD = "the file is damaged or incomplete: download or export it again"


def sniff(prefix: bytes) -> str | None:
    """Recognise what is commonly found where a shard should be."""
    head = prefix.lstrip()
    if head.startswith(b"version https://git-lfs"):
        return "lfs"
    low = head[:64].lower()
    if low.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head", b"<body")):
        return "html"
    return None


def _check_prefix(hdr: Header, prefix: bytes) -> int | None:
    """Checks that need only the first bytes and the file size. Returns the header length when
    the JSON can be read, None when a finding already makes the file unreadable."""
    shown, size = hdr.path, hdr.file_size
    kind = sniff(prefix)
    if kind == "lfs":
        hdr.add("header.lfs_pointer",
                f"{shown} is a git-LFS pointer ({size} bytes), not the safetensors data",
                hint="run `git lfs pull` (or download the file again) to fetch the real content")
        return None
    if kind == "html":
        hdr.add("header.html_page",
                f"{shown} is an HTML/XML page ({size} bytes), not a safetensors file",
                hint="the download saved an error or login page: download the file again")
        return None
    if size < 8:
        hdr.add("header.too_small",
                f"{shown} is {size} bytes, smaller than the 8-byte header length field",
                hint=_REDOWNLOAD)
        return None
    (n,) = struct.unpack("<Q", prefix[:8])
    hdr.header_len = n
    if n > MAX_HEADER_SIZE:
        hdr.add("header.too_large",
                f"{shown}: header length {n} exceeds the 100,000,000-byte limit",
                hint="this is not a safetensors file, or its first 8 bytes are corrupt",
                header_len=n)
        return None
    if 8 + n > size:
        hdr.add("header.length_exceeds_file",
                f"{shown}: header length {n} runs past the end of the {size}-byte file",
                hint=_REDOWNLOAD, header_len=n)
        return None
    if n > HUB_MAX_HEADER_SIZE:
        hdr.add("header.hub_limit",
                f"{shown}: header of {n} bytes is over the Hub's 25,000,000-byte metadata limit",
                severity=WARNING, hint="the Hub's metadata API will refuse this file; use fewer, larger tensors",
                header_len=n)
    return n


def read_header(path: str | os.PathLike[str], *, display: str | None = None) -> Header:
    """Parse and validate the header of one safetensors file.

    Never raises for a malformed file: every problem is a finding on the returned header. Raises
    :class:`CkptctlError` only when the file cannot be read at all (missing, permission denied).
    """
    return _read(os.fspath(path), display)


def read_header_ahead(path: str | os.PathLike[str],
                      sink: Callable[[str, str, read_ahead.Identity, Header], None] = read_ahead.keep) -> None:
    """Parse a header now for a later :func:`read_header` of the same path (display = path):
    ``sink(path, display, identity, header)`` gets it (by default it is kept for that read, inside
    a :func:`ckptctl.format.read_ahead.scope`). A file that cannot be read, or whose header stops
    before its JSON, is left to that read."""
    try:
        _read(os.fspath(path), None, sink=sink)
    except CkptctlError:
        pass


def _read(p: str, display: str | None, *,
          sink: Callable[[str, str, read_ahead.Identity, Header], None] | None = None) -> Header:
    shown = display or p
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what it is.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                hdr = Header(path=shown, file_size=0)
                hdr.add("header.not_a_file", f"{shown} is not a regular file (a FIFO, device or directory)",
                        hint="replace it with the real shard")
                return hdr
            if sink is None and (kept := read_ahead.take(p, shown, st)) is not None:
                return kept
            size = st.st_size
            hdr = Header(path=shown, file_size=size)
            prefix = f.read(min(size, 512))
            n = _check_prefix(hdr, prefix)
            if n is None:
                return hdr
            if n <= len(prefix) - 8:
                raw, got = bytearray(prefix[8:8 + n]), n
            else:
                f.seek(8)
                raw = bytearray(n)
                got = f.readinto(raw)
    except OSError as exc:
        raise from_oserror(exc, "cannot read safetensors file") from None
    if got != n:  # the file shrank while we read it
        hdr.add("header.length_exceeds_file",
                f"{shown}: header length {n} runs past the end of the file (it changed while being read)",
                hint=_REDOWNLOAD, header_len=n)
        return hdr
    _parse_into(hdr, raw)
    if sink is not None:
        sink(p, shown, read_ahead.identity(st), hdr)
    return hdr


def parse_header_bytes(data: bytes, *, path: str = "<bytes>") -> Header:
    """Validate a whole in-memory safetensors file (used by tests and fuzzing); the same checks
    and findings as :func:`read_header`."""
    hdr = Header(path=path, file_size=len(data))
    n = _check_prefix(hdr, data[:512])
    if n is None:
        return hdr
    _parse_into(hdr, bytearray(memoryview(data)[8:8 + n]))
    return hdr


def _parse_into(hdr: Header, raw: bytearray) -> None:
    """Decode and check the header bytes; ``raw`` is emptied once decoded, and the text is
    dropped once read (a 90 MB header is never held twice, nor beside its names' set)."""
    with paused():
        _parse_text(hdr, raw)


def _parse_text(hdr: Header, raw: bytearray) -> None:
    shown = hdr.path
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        hdr.add("header.not_utf8", f"{shown}: header is not valid UTF-8 (byte {exc.start + 8})",
                hint=_REDOWNLOAD, position=exc.start + 8)
        return
    del raw[:]
    stripped = text.lstrip(" \t\r\n")
    if not stripped.startswith("{"):
        hdr.add("header.not_object", f"{shown}: header does not start with '{{'", hint=_REDOWNLOAD)
        return
    if len(stripped) != len(text):
        hdr.add("header.leading_whitespace",
                f"{shown}: header has {len(text) - len(stripped)} bytes of whitespace before '{{'",
                severity=WARNING, hint="the format says the header MUST begin with '{'; re-save the file")
    del text
    cols = _Columns()
    try:
        doc = _read_object(stripped, cols)
        padding = stripped[doc.end:]
        del stripped  # the text goes before the names are checked for a repeat (a set of them)
        repeated = cols.first_repeat()
        if repeated is not None:
            raise DuplicateKey(repeated)  # as json's own object hook refuses it: once the object is read
    except DuplicateKey as exc:
        hdr.add("header.duplicate_key", f"{shown}: key {exc.key!r} appears more than once in the header",
                tensor=exc.key, hint="parsers disagree on which copy wins: re-export the file")
        return
    except (json.JSONDecodeError, RecursionError, _BadJson) as exc:
        msg = (exc.msg if isinstance(exc, json.JSONDecodeError)
               else "nesting too deep" if isinstance(exc, RecursionError) else str(exc))
        hdr.add("header.bad_json", f"{shown}: header is not valid JSON: {msg}", hint=_REDOWNLOAD)
        return
    # Entries of the usual shape hold nothing serde_json refuses (depth 3, no escape in a known
    # dtype), and each top-level key was checked as it was read: the walk visits only the rest.
    problem = doc.top_problem or _serde_problem({name: value for _, name, value in doc.rest})
    if problem:
        hdr.add("header.bad_json", f"{shown}: header is not valid JSON for safetensors: {problem}",
                hint=_REDOWNLOAD)
        return
    if padding.strip(" "):
        if padding.strip(" \t\r\n"):
            bad = next(c for c in padding if c not in " \t\r\n")
            hdr.add("header.bad_padding",
                    f"{shown}: header is padded with {bad!r} after the JSON object (only spaces are allowed)",
                    hint="safetensors refuses this file: re-export it")
        else:
            hdr.add("header.whitespace_padding",
                    f"{shown}: header padding contains tabs or newlines (the format allows only spaces)",
                    severity=WARNING, hint="re-save the file with ckptctl resave")
    _check_metadata(hdr, doc)
    for row, name, value in doc.rest:
        if row is not None:
            cols.put(row, _check_entry(hdr, name, value))
    _validate_layout(hdr, cols.table())


# One tensor entry exactly as safetensors (serde_json) and json.dumps(separators=(",", ":")) write
# it, followed by a comma: name (no escape, no control character), then one group for the dtype
# and shape text (the key of the kind cache), then begin and end. Dimensions >= 1 and numbers of
# at most 16/19 digits: anything else (a zero dimension, a huge number, whitespace, an escape,
# another key order) takes the generic path, which decides exactly as the JSON parser does.
_CANONICAL = re.compile(
    r'"([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]{1,16}","shape":\[(?:[1-9][0-9]{0,15}(?:,[1-9][0-9]{0,15})*)?)\],'
    r'"data_offsets":\[(0|[1-9][0-9]{0,18}),(0|[1-9][0-9]{0,18})\]\},')
# _CANONICAL with every group a negated class (about half the time), for a header whose text is
# ASCII and holds no control character and no backslash: its names are then what _CANONICAL's are,
# and the rest is checked by the caller (a known dtype, _DIMS, _DIGITS).
_LOOSE = re.compile(r'"([^"]*)":\{"dtype":"([^"]*","shape":\[[^\]]*)\],"data_offsets":\[([^,]*),([^\]]*)\]\},')
_DIMS = re.compile(r"(?:[1-9][0-9]{0,15}(?:,[1-9][0-9]{0,15})*)?")  # _CANONICAL's dimensions
_NOT_PLAIN = (*map(chr, range(32)), "\\")  # one memchr pass each over a header
# begin or end texts joined by commas, each digits only, for the texts _LOOSE took (json.loads,
# which then reads them, would take spaces, a sign, a fraction, and read -0 as 0; it refuses a
# leading zero itself)
_DIGITS = re.compile(r"[0-9]+(?:,[0-9]+)*")
_WS = re.compile(r"[ \t\n\r]*")  # the JSON parser's whitespace
_FAST_CACHE = 1 << 16  # distinct dtype+shape texts remembered (a hostile header may have one per entry)
_CHUNK = 1 << 20  # characters of canonical entries taken at once by _Columns.bulk
_FIXED = len('"":{"dtype":"],"data_offsets":[,]},')  # a canonical entry's characters outside its groups


@dataclass
class _Doc:
    """What reading the top-level object found besides the tensor columns."""

    end: int = 0  # just past the closing brace
    meta_present: bool = False
    meta: Any = None
    # entries that are not plain tensors, with their row (None: __metadata__), for the serde walk
    # and _check_entry, in document order
    rest: list[tuple[int | None, str, Any]] = field(default_factory=list)
    top_problem: str | None = None  # the first lone surrogate in a top-level key or string value


class _Columns:
    """The tensors as the header lists them (file order), one compact row each."""

    def __init__(self) -> None:
        self.names: list[str] = []  # by row; a repeated name is found once the object is read
        self.begin: Offsets = array("Q")
        self.end: Offsets = array("Q")
        self.kind: array[int] = array("I")
        self.kinds: list[tuple[str, tuple[int, ...]]] = []
        self.codes: dict[tuple[str, tuple[int, ...]], int] = {}
        self.fast: dict[str, tuple[int, int] | None] = {}  # dtype+shape text -> (kind, nbytes) or None
        self.dropped: list[int] = []
        self.metadata_repeat: int | None = None  # rows read before a second __metadata__
        self.rows: dict[str, int] | None = None  # name -> row, by first_repeat
        self.plain: bool | None = None  # the header's text may be read by _LOOSE (set by bulk)
        # every row so far taken by bulk, from 0, each beginning where the one before ends: the
        # rows are then in offset order and contiguous (each holds at least a byte)
        self.chained = True

    def code(self, dtype: str, shape: tuple[int, ...]) -> int:
        key = (dtype, shape)
        c = self.codes.get(key)
        if c is None:
            c = self.codes[key] = len(self.kinds)
            self.kinds.append(key)
        return c

    def fast_kind(self, text: str) -> tuple[int, int] | None:
        """(kind, nbytes) of a canonical entry's dtype and shape text, or None when the entry
        needs the generic checks (an unknown dtype, too many elements, a partial byte)."""
        dtype, _, dims = text.partition('","shape":[')
        d = dt.BY_NAME.get(dtype)
        if d is None or _DIMS.fullmatch(dims) is None:  # as _CANONICAL reads them (_LOOSE takes more)
            return None
        shape = tuple(map(int, dims.split(","))) if dims else ()
        numel = 1
        for x in shape:
            numel *= x
        bits = numel * d.bits
        if numel > MAX_DIM_PRODUCT or bits % 8:
            return None
        return self.code(dtype, shape), bits >> 3

    def first_repeat(self) -> str | None:
        """The first key that repeats an earlier one, in the order of the header (a dict of the
        names to their rows answers whether there is one, and is the table's look-up by name
        when rows keep their order; only when a name repeats are they walked)."""
        names = self.names
        row = None
        self.rows = dict(zip(names, range(len(names))))
        if len(self.rows) != len(names):
            seen: set[str] = set()
            row = next(i for i, n in enumerate(names) if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        if self.metadata_repeat is not None and (row is None or self.metadata_repeat <= row):
            return METADATA_KEY
        return None if row is None else names[row]

    def append(self, begin: int, end: int, code: int) -> None:
        if self.chained:  # (a row to be filled by put is appended as 0, 0: not chained)
            self.chained = end > begin == (self.end[-1] if self.end else 0)
        if (begin | end) >> 64:
            self._widen()
        self.begin.append(begin)
        self.end.append(end)
        self.kind.append(code)

    def put(self, row: int, info: TensorInfo | None) -> None:
        """Fill the row kept for an entry the generic checks read (None: it holds no tensor)."""
        if info is None:
            self.dropped.append(row)
            return
        if (info.begin | info.end) >> 64:
            self._widen()
        self.begin[row], self.end[row] = info.begin, info.end
        self.kind[row] = self.code(info.spec.dtype, info.spec.shape)  # type: ignore[arg-type]

    def _widen(self) -> None:
        if isinstance(self.begin, array):
            self.begin, self.end = list(self.begin), list(self.end)

    def known(self, ks: str) -> tuple[int, int] | None:
        """:meth:`fast_kind`, remembered."""
        known = self.fast.get(ks, False)
        if known is False:
            known = self.fast_kind(ks)
            if len(self.fast) < _FAST_CACHE:
                self.fast[ks] = known
        return known  # type: ignore[return-value]

    def bulk(self, text: str, pos: int) -> tuple[int, int]:
        """Take the canonical entries from ``pos`` on, a chunk of about ``_CHUNK`` characters at
        a time (ending after an entry's ``},``), with every per-entry step done by C loops: the
        regex's matches must tile the chunk exactly (so nothing between them was skipped), each
        size must match its dtype and shape. Returns where it stopped and the end of the chunk it
        refused (the caller reads that one entry by entry before it calls again; ``pos`` when the
        entry at ``pos`` is not canonical; the end of two chunks, or of ``text``, when no entry
        boundary is left to cut a chunk at)."""
        if self.plain is None:
            self.plain = text.isascii() and not any(c in text for c in _NOT_PLAIN)
        findall, n = (_LOOSE if self.plain else _CANONICAL).findall, len(text)
        while True:
            # Every step here is bounded by two chunks, so a header that is never canonical (written
            # with ", " separators, say) costs one failed match per entry, not a search to its end.
            if _CANONICAL.match(text, pos) is None:
                return pos, pos  # this entry needs the JSON parser (``__metadata__`` first, most often)
            window = pos + 2 * _CHUNK
            if window >= n:  # the tail: up to the last entry followed by another
                if (cut := text.rfind('},"', pos)) <= pos:
                    return pos, n
            elif (cut := text.find('},"', pos + _CHUNK, window)) == -1 and (cut := text.rfind('},"', pos, window)) <= pos:
                return pos, window  # no entry boundary in two chunks: the entry path reads them
            stop = cut + 2
            found = findall(text, pos, stop)
            if not found:
                return pos, stop
            names, kss, bs, es = zip(*found)
            k = len(names)
            # (lengths of joins: a C copy each, cheaper than a len() call per group)
            if (k * _FIXED + len("".join(names)) + len("".join(kss)) + len("".join(bs)) + len("".join(es))
                    != stop - pos):
                return pos, stop  # something between or around the matches is not canonical
            known = [self.known(ks) for ks in set(kss)]
            if None in known or METADATA_KEY in names:
                return pos, stop
            chained = bs[1:] == es[:-1]  # each begins where the one before ends (every writer's order)
            ends, firsts = ",".join(es), bs[0] if chained else ",".join(bs)
            if self.plain and not (_DIGITS.fullmatch(ends) and _DIGITS.fullmatch(firsts)):
                return pos, stop
            try:
                # one C parse of them all (a leading zero: ValueError)
                end = array("Q", json.loads(f"[{ends}]"))
                # numbers without leading zeros: equal texts, equal values
                begin = array("Q", (int(firsts),)) + end[:-1] if chained else array("Q", json.loads(f"[{firsts}]"))
            except (OverflowError, ValueError):  # past 2**64, or int's digit limit (_LOOSE bounds no length)
                return pos, stop
            kinds = list(map(self.known if len(self.fast) >= _FAST_CACHE else self.fast.__getitem__, kss))
            if not all(map(operator.eq, map(operator.sub, end, begin), map(operator.itemgetter(1), kinds))):
                return pos, stop
            if self.chained:
                self.chained = chained and begin[0] == (self.end[-1] if self.end else 0)
            self.names.extend(names)
            self.begin.extend(begin)
            self.end.extend(end)
            self.kind.extend(map(operator.itemgetter(0), kinds))
            pos = stop

    def one_by_one(self, text: str, pos: int, stop: int) -> int:
        """Canonical entries one regex match at a time, up to ``stop``; returns where the first
        entry that needs the JSON parser starts."""
        match = _CANONICAL.match
        names, begins, ends, kinds = self.names.append, self.begin.append, self.end.append, self.kind.append
        last = self.end[-1] if self.end else 0
        while pos < stop and (m := match(text, pos)) is not None:
            name, ks, b, e = m.groups()
            known = self.known(ks)
            if known is None or name == METADATA_KEY:
                break
            begin, end = int(b), int(e)
            if end - begin != known[1]:
                break
            if begin != last:  # (each holds a byte at least: the chain is in offset order)
                self.chained = False
            last = end
            names(name)
            begins(begin)
            ends(end)
            kinds(known[0])
            pos = m.end()
        return pos

    def entry(self, doc: _Doc, name: str, value: Any) -> None:
        """One entry read by the JSON parser (the generic path)."""
        if doc.top_problem is None:
            doc.top_problem = _surrogate(name) or (_surrogate(value) if isinstance(value, str) else None)
        if name == METADATA_KEY:
            if doc.meta_present:
                if self.metadata_repeat is None:
                    self.metadata_repeat = len(self.names)
                return
            doc.meta_present, doc.meta = True, value
            doc.rest.append((None, name, value))
            return
        row = len(self.names)
        self.names.append(name)
        plain = _plain(value)
        if plain is not None:
            self.append(plain[1], plain[2], self.code(plain[0], plain[3]))
        else:
            self.append(0, 0, 0)  # filled by put() once the object is read
            doc.rest.append((row, name, value))

    def table(self) -> TensorTable:
        """The rows in data-offset order (a stable sort: equal offsets keep the file's order)."""
        names, begin, end, kind = self.names, self.begin, self.end, self.kind
        rows = self.rows
        if self.dropped or not (self.chained or _in_order(begin, end)):
            gone = set(self.dropped)
            order = sorted((r for r in range(len(kind)) if r not in gone), key=lambda r: (begin[r], end[r]))
            names = [names[r] for r in order]
            begin, end, kind = _take(begin, order), _take(end, order), _take(kind, order)
            rows = None  # other rows: made again by the first look-up
        table = TensorTable(names, begin, end, kind, self.kinds)
        table._rows, table._contiguous = rows, self.chained
        return table


def _take(col: Any, order: list[int]) -> Any:
    values = map(col.__getitem__, order)
    return array(col.typecode, values) if isinstance(col, array) else list(values)


def _in_order(begin: Offsets, end: Offsets) -> bool:
    if all(map(operator.lt, begin, islice(begin, 1, None))):
        return True
    pairs = list(zip(begin, end))
    return all(map(operator.le, pairs, islice(pairs, 1, None)))


def _surrogate(s: str) -> str | None:
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return f"lone surrogate escape in string {s[:40]!r}"
    return None


def _plain(entry: Any) -> tuple[str, int, int, tuple[int, ...]] | None:
    """(dtype, begin, end, shape) of an entry :func:`_check_entry` would accept without a finding,
    found with exact type checks; None for anything unusual (an unknown key or dtype, a zero
    dimension, a size that does not match), which is left to :func:`_check_entry`."""
    if type(entry) is not dict or len(entry) != 3:
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (type(dtype) is not str or type(shape) is not list or type(offsets) is not list
            or len(offsets) != 2 or dtype not in dt.BY_NAME):
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        return None
    numel = 1
    for x in shape:
        if type(x) is not int or x < 1:
            return None
        numel *= x
    # every dimension >= 1: the running product only grows, so the last one is the largest
    bits = numel * dt.BY_NAME[dtype].bits
    if numel <= MAX_DIM_PRODUCT and not bits % 8 and end - begin == bits >> 3:
        return dtype, begin, end, tuple(shape)
    return None


def _scan_value(text: str, pos: int) -> tuple[Any, int]:
    """One JSON value at ``pos`` with serde_json's rules. A failure of the fast decoder (an
    integer over Python's digit limit, bad JSON) is decided again by the strict one, which names
    the problem; so is a value whose text holds a ``-0`` (the fast one reads a negative zero as
    0: only the strict one tells them apart)."""
    try:
        value, end = _FAST.scan_once(text, pos)
    except (ValueError, RecursionError, _BadJson, DuplicateKey, StopIteration):
        pass
    else:
        if text.find("-0", pos, end) < 0:
            return value, end
    try:
        return _STRICT.scan_once(text, pos)  # type: ignore[no-any-return]
    except StopIteration:
        raise json.JSONDecodeError("Expecting value", text, pos) from None


def _read_object(text: str, cols: _Columns) -> _Doc:
    """Read the top-level object at ``text[0]`` as ``json``'s own object parser does (the same
    errors at the same places, the first repeated key refused once the object closes), storing
    each tensor entry as a row of ``cols`` instead of a dict: the canonical form by one regex
    match, anything else by the JSON parser."""
    doc = _Doc()
    n, ws = len(text), _WS.match
    pos = ws(text, 1).end()
    if pos < n and text[pos] == "}":
        doc.end = pos + 1
        return doc
    stop = pos
    while True:
        if pos >= stop:  # past the chunk bulk refused last (each chunk is tried once)
            pos, stop = cols.bulk(text, pos)
        pos = ws(text, cols.one_by_one(text, pos, stop)).end()  # a canonical entry ends with its comma
        # one entry by the JSON parser
        if pos >= n or text[pos] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
        name, pos = scanstring(text, pos + 1, True)
        pos = ws(text, pos).end()
        if pos >= n or text[pos] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
        value, pos = _scan_value(text, ws(text, pos + 1).end())
        cols.entry(doc, name, value)
        pos = ws(text, pos).end()
        if pos < n and text[pos] == "}":
            break
        if pos >= n or text[pos] != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = ws(text, pos + 1).end()
    doc.end = pos + 1
    return doc


def _check_metadata(hdr: Header, doc: _Doc) -> None:
    shown, meta = hdr.path, doc.meta
    if not doc.meta_present or meta is None:
        return
    if isinstance(meta, dict) and {"dtype", "shape", "data_offsets"} <= set(meta):
        hdr.add("header.metadata_tensor",
                f"{shown}: a tensor is named {METADATA_KEY!r}; safetensors cannot read it back",
                tensor=METADATA_KEY, hint="rename the tensor and re-export")
    elif not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        hdr.add("header.bad_metadata",
                f"{shown}: {METADATA_KEY} must map strings to strings",
                hint="safetensors refuses this file: re-export it with string metadata")
    else:
        hdr.metadata = dict(meta)
        fmt = meta.get("format")
        if fmt not in VALID_FORMATS:
            hdr.add("header.format_missing" if fmt is None else "header.format_unknown",
                    f"{shown}: {METADATA_KEY}.format is {fmt!r}, huggingface_hub's loader expects 'pt' or 'mlx'",
                    severity=WARNING, hint="re-save with ckptctl resave to set format=pt")


def _validate_layout(hdr: Header, table: TensorTable) -> None:
    """Holes, overlaps, trailing bytes, truncation and alignment of the tensors (in offset order)."""
    shown = hdr.path
    begin, end = table._begin, table._end
    if table._contiguous or ((not begin or begin[0] == 0) and all(map(operator.eq, islice(begin, 1, None), end))):
        expected = end[-1] if end else 0  # contiguous from 0: nothing to report
    else:
        expected = 0
        for t in table.values():
            if t.begin > expected:
                hdr.add("header.offset_hole",
                        f"{shown}: {expected} unused bytes before tensor {t.name!r} (data_offsets [{t.begin}, {t.end}], "
                        f"previous tensor ends at {expected})", tensor=t.name,
                        hint="the data section must be fully covered: re-export the file",
                        begin=t.begin, end=t.end, expected=expected)
            elif t.begin < expected:
                hdr.add("header.offset_overlap",
                        f"{shown}: tensor {t.name!r} (data_offsets [{t.begin}, {t.end}]) overlaps the previous "
                        f"tensor, which ends at {expected}", tensor=t.name,
                        hint="two tensors share bytes: re-export the file", begin=t.begin, end=t.end, expected=expected)
            expected = max(expected, t.end)
    data_len = hdr.file_size - hdr.data_start
    if not has_errors(hdr.findings):
        if expected < data_len:
            hdr.add("header.trailing_bytes",
                    f"{shown}: {data_len - expected} bytes after the last tensor (data ends at {expected}, "
                    f"file holds {data_len})", hint="run ckptctl resave --repair to drop them",
                    data_end=expected, data_len=data_len)
        elif expected > data_len:
            hdr.add("header.truncated",
                    f"{shown}: file is truncated: tensors need {expected} data bytes, file holds {data_len}",
                    hint=_REDOWNLOAD, data_end=expected, data_len=data_len)
    if hdr.header_len % 8:
        hdr.add("header.unaligned_header",
                f"{shown}: header length {hdr.header_len} is not a multiple of 8", severity=WARNING,
                hint="tensors may be misaligned for zero-copy loaders; ckptctl resave aligns them")
    else:
        # the data section starts at a multiple of 8, so a tensor is aligned when its begin is a
        # multiple of its element size (1, 2, 4 or 8 bytes; 1 for sub-byte or unknown dtypes)
        sizes = [(d.bits >> 3) if (d := dt.BY_NAME.get(dtype)) and d.bits >= 8 else 1
                 for dtype, _ in table.kinds]
        if any(map(operator.mod, begin, map(sizes.__getitem__, table.kind_codes))):
            start = hdr.data_start
            for t in table.values():
                size = sizes[table.kind_codes[table.row_of(t.name)]]
                if (start + t.begin) % size:
                    hdr.add("header.unaligned_tensor",
                            f"{shown}: tensor {t.name!r} starts at byte {start + t.begin}, "
                            f"not a multiple of its {size}-byte element", severity=WARNING,
                            tensor=t.name, hint="ckptctl resave lays tensors out aligned")
    hdr.tensors = table


def _check_entry(hdr: Header, name: str, entry: Any) -> TensorInfo | None:
    shown = hdr.path
    if not isinstance(entry, dict):
        hdr.add("header.bad_entry", f"{shown}: entry for tensor {name!r} is not an object", tensor=name,
                hint=_REDOWNLOAD)
        return None
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        hdr.add("header.bad_entry", f"{shown}: tensor {name!r} lacks {', '.join(missing)}", tensor=name,
                hint=_REDOWNLOAD)
        return None
    extra = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
    if extra:
        hdr.add("header.extra_field", f"{shown}: tensor {name!r} has unknown fields {extra}",
                severity=WARNING, tensor=name, hint="other readers may reject them; ckptctl resave drops them")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    d = dt.get(dtype) if isinstance(dtype, str) else None
    if d is None:
        hdr.add("header.unknown_dtype", f"{shown}: tensor {name!r} has unknown dtype {dtype!r}",
                tensor=name, hint="known dtypes: " + " ".join(x.name for x in dt.DTYPES))
    if (not isinstance(shape, list)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in shape)):
        hdr.add("header.bad_shape", f"{shown}: tensor {name!r} has shape {shape!r}, not a list of integers",
                tensor=name, hint=_REDOWNLOAD)
        return None
    if any(x < 0 for x in shape):
        hdr.add("header.negative_shape", f"{shown}: tensor {name!r} has a negative dimension in {shape}",
                tensor=name, hint=_REDOWNLOAD)
        return None
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in offsets)):
        hdr.add("header.bad_offsets", f"{shown}: tensor {name!r} has data_offsets {offsets!r}, "
                "not two non-negative integers", tensor=name, hint=_REDOWNLOAD)
        return None
    begin, end = offsets
    if end < begin:
        hdr.add("header.bad_offsets", f"{shown}: tensor {name!r} ends before it begins "
                f"(data_offsets [{begin}, {end}])", tensor=name, hint=_REDOWNLOAD, begin=begin, end=end)
        return None
    numel = 1
    for x in shape:
        numel *= x
        if numel > MAX_DIM_PRODUCT:
            hdr.add("header.overflow", f"{shown}: tensor {name!r} shape {shape} overflows the 2^48 element limit",
                    tensor=name, hint=_REDOWNLOAD)
            return None
    info = TensorInfo(TensorSpec(name, dtype if isinstance(dtype, str) else "?", tuple(shape)), begin, end)
    if d is not None:
        bits = numel * d.bits
        if bits % 8:
            hdr.add("header.misaligned_slice",
                    f"{shown}: tensor {name!r} ({d.name} x {numel}) does not fill whole bytes",
                    tensor=name, hint=_REDOWNLOAD)
        elif end - begin != bits // 8:
            hdr.add("header.size_mismatch",
                    f"{shown}: tensor {name!r} {d.name}{list(shape)} needs {bits // 8} bytes but "
                    f"data_offsets [{begin}, {end}] span {end - begin}", tensor=name, hint=_REDOWNLOAD,
                    begin=begin, end=end, expected=bits // 8)
    return info


def load_header(path: str | os.PathLike[str], *, display: str | None = None) -> Header:
    """Read a header and raise :class:`InputError` (listing every error) if it is invalid."""
    hdr = read_header(path, display=display)
    errors = [f for f in hdr.findings if f.severity == ERROR]
    if errors:
        first = errors[0]
        more = f" (+{len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise InputError(f"{first.message} [{first.code}]{more}",
                         first.hint or f"run `ckptctl verify {hdr.path}` for every problem")
    return hdr


# --------------------------------------------------------------------------------------------
# Encoding


def layout_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The order the official writer lays tensors out in: dtype rank descending, then name (a
    sort by name, then a stable sort by rank: C-level keys, no key tuple per tensor)."""
    by_name = sorted(specs, key=_NAME)
    neg = _NEG_RANK
    ranks = [neg[s.dtype] for s in by_name]
    if len(set(ranks)) <= 1:
        return by_name
    return list(map(by_name.__getitem__, sorted(range(len(ranks)), key=ranks.__getitem__)))


_NAME = operator.attrgetter("name")
_NEG_RANK = {name: -rank for name, rank in dt.RANK.items()}
_KINDS_BY_ID = 1 << 12


def encode_header(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None, *, extra_pad: int = 0
                  ) -> tuple[bytes, list[TensorInfo]]:
    """Header bytes (8-byte length + JSON padded with spaces to a multiple of 8) and the tensors
    with their data offsets, in file order. Byte-identical to ``safetensors.torch.save_file``;
    ``extra_pad`` (a multiple of 8) more spaces move the data section that far (the Rust parser
    accepts trailing whitespace in the JSON: the writer uses it to place tensors where the
    kernel can clone them)."""
    if extra_pad < 0 or extra_pad % 8:
        raise ValueError("extra header padding must be a non-negative multiple of 8")
    with paused():
        return _encode(layout_order(specs), metadata, extra_pad)


def _encode(ordered: list[TensorSpec], metadata: dict[str, str] | None, extra_pad: int
            ) -> tuple[bytes, list[TensorInfo]]:
    """The header by column: each kind's JSON text (dtype, shape, up to the offsets) made once, the
    offsets by one running sum, the whole text by one join of every entry's pieces, and the
    layout's records by :func:`by_columns` (no dict or list per entry, no ``json.dumps`` of 90k
    of them: 0.25 s -> 0.11 s for DeepSeek-V3's 92k tensors). The same bytes as
    :func:`_encode_by_object`, which takes anything unusual: a name that is not a ``str``, a
    dimension that is not an ``int`` among many distinct shapes."""
    meta = _checked_metadata(metadata)
    # (comprehensions: the interpreter's specialised attribute reads beat attrgetter here)
    names, dtypes_, shapes = [s.name for s in ordered], [s.dtype for s in ordered], [s.shape for s in ordered]
    if not set(map(type, names)) <= {str}:
        return _encode_by_object(ordered, metadata, extra_pad)
    if not (set(map(type, ordered)) <= {TensorSpec} and set(map(type, shapes)) <= {tuple}):
        ordered = [s if type(s) is TensorSpec and type(s.shape) is tuple else TensorSpec(s.name, s.dtype, tuple(s.shape))
                   for s in ordered]
        shapes = [s.shape for s in ordered]
    if len(set(names)) != len(names) or METADATA_KEY in names:
        _refuse_names(names)
    # each kind's text (from its dtype to the offsets) and size made once: a kind is a dtype and
    # a shape object (a header's table shares one per kind), or a shape where the objects are many
    ids = [id(shape) for shape in shapes]
    if len(set(ids)) > _KINDS_BY_ID:
        if not set(map(type, chain.from_iterable(shapes))) <= {int}:
            return _encode_by_object(ordered, metadata, extra_pad)  # as a key, True would be 1
        ids = shapes
    keys = list(zip(dtypes_, ids))
    kind_text: dict[tuple[Any, Any], str] = {}
    kind_size: dict[tuple[Any, Any], int] = {}
    for key, spec in dict(zip(keys, ordered)).items():  # one spec of each kind: any gives the same text
        kind_text[key] = (f'":{{"dtype":{json.dumps(spec.dtype, ensure_ascii=False)},"shape":'
                          f'{json.dumps(list(spec.shape), separators=(",", ":"))},"data_offsets":[')
        kind_size[key] = spec.nbytes  # an unknown dtype: KeyError, as in _encode_by_object
    ends = list(accumulate(map(kind_size.__getitem__, keys)))
    begins = [0, *ends[:-1]] if ends else []
    end_texts = list(map(str, ends))
    # the whole text as one join of every entry's pieces: '"' (after a comma), the name up to
    # its closing quote, its kind's text, the offsets
    joined = "".join(names)
    plain = len(_encode_string(joined)) == len(joined) + 2  # no name needs an escape
    del joined
    open_quote = chain(('"' if meta is None else ',"',), repeat(',"'))
    quoted = names if plain else (e[1:-1] for e in map(_encode_string, names))
    head = "{" if meta is None else "{" + json.dumps({METADATA_KEY: meta}, separators=(",", ":"), ensure_ascii=False)[1:-1]
    text = "".join(chain((head,), chain.from_iterable(zip(
        open_quote, quoted, map(kind_text.__getitem__, keys), chain(("0",), end_texts), repeat(","), end_texts,
        repeat("]}"))), ("}",))).encode("utf-8")
    return _framed(text, extra_pad), by_columns(TensorInfo, ordered, begins, ends)


def _checked_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError("safetensors metadata must map strings to strings")
    return dict(metadata)


def _refuse_names(names: list[str]) -> None:
    """The error for the first name the header cannot hold, in order."""
    seen: set[str] = set()
    for name in names:
        if name == METADATA_KEY:
            raise ValueError(f"a tensor cannot be named {METADATA_KEY!r}")
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)


def _framed(text: bytes, extra_pad: int) -> bytes:
    """The 8-byte length, ``text`` and its padding (one copy of ``text``)."""
    pad = (-len(text)) % 8 + extra_pad
    if len(text) + pad > MAX_HEADER_SIZE:
        raise ValueError("header too large")
    return b"".join((struct.pack("<Q", len(text) + pad), text, b" " * pad))


def _encode_by_object(ordered: list[TensorSpec], metadata: dict[str, str] | None, extra_pad: int
                      ) -> tuple[bytes, list[TensorInfo]]:
    """The header as ``json.dumps`` of one object of every entry: what :func:`_encode` must equal
    byte for byte (the tests hold it to this)."""
    meta = _checked_metadata(metadata)
    obj: dict[str, Any] = {} if meta is None else {METADATA_KEY: meta}
    infos: list[TensorInfo] = []
    offset = 0
    for s in ordered:
        name = s.name
        if name == METADATA_KEY:
            raise ValueError(f"a tensor cannot be named {METADATA_KEY!r}")
        if name in obj:
            raise ValueError(f"duplicate tensor name {name!r}")
        n = s.nbytes
        obj[name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + n]}
        spec = s if type(s) is TensorSpec and type(s.shape) is tuple else TensorSpec(name, s.dtype, tuple(s.shape))
        infos.append(TensorInfo(spec, offset, offset + n))
        offset += n
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return _framed(text, extra_pad), infos


def header_size_of(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    """Total bytes of the encoded header (length field included)."""
    return len(encode_header(specs, metadata)[0])


