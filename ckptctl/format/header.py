"""Read and validate safetensors headers without torch: the public entry points and the strict
reader, the reference every faster reader must equal.

:func:`read_header` (a file), :func:`parse_header_bytes` (a whole file in memory) and
:func:`load_header` (raises on errors) take ``fast``: on (the default), the typed decoder of
:mod:`ckptctl.format.header_fast` reads the header when it can prove it reads it as this module
would, and this module's reader takes everything else; off, only this module's reader runs. The
rules that turn what was read into findings are :mod:`ckptctl.format.header_rules`, shared by
both. The tensor table is :mod:`ckptctl.format.table`, the encoder :mod:`ckptctl.format.encode`;
their names are importable from here too.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from json.decoder import scanstring
from typing import Any

from ckptctl.errors import InputError, from_oserror
from ckptctl.findings import ERROR, WARNING
from ckptctl.format import dtypes as dt
from ckptctl.format.encode import encode_header, header_size_of, layout_order
from ckptctl.format.header_rules import (
    HUB_MAX_HEADER_SIZE,
    MAX_DIM_PRODUCT,
    MAX_HEADER_SIZE,
    METADATA_KEY,
    REDOWNLOAD,
    VALID_FORMATS,
    Header,
    check_entry,
    check_metadata,
    check_padding,
    validate_layout,
)
from ckptctl.format.table import (
    MergedSpecs,
    Offsets,
    Rows,
    SpecView,
    TensorInfo,
    TensorTable,
)
from ckptctl.gcpause import paused

__all__ = [
    "HUB_MAX_HEADER_SIZE", "MAX_DIM_PRODUCT", "MAX_HEADER_SIZE", "MAX_JSON_DEPTH", "METADATA_KEY", "VALID_FORMATS",
    "DuplicateKey", "Header", "MergedSpecs", "Offsets", "SpecView", "TensorInfo", "TensorTable",
    "checked", "decode_header", "encode_header", "header_size_of", "layout_order", "load_header", "no_duplicate_keys",
    "parse_header_bytes", "read_header", "read_header_bytes", "sniff",
]


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
                hint=REDOWNLOAD)
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
                hint=REDOWNLOAD, header_len=n)
        return None
    if n > HUB_MAX_HEADER_SIZE:
        hdr.add("header.hub_limit",
                f"{shown}: header of {n} bytes is over the Hub's 25,000,000-byte metadata limit",
                severity=WARNING, hint="the Hub's metadata API will refuse this file; use fewer, larger tensors",
                header_len=n)
    return n



def read_header(path: str | os.PathLike[str], *, display: str | None = None, fast: bool = True) -> Header:
    """Parse and validate the header of one safetensors file (``fast``: see the module).

    Never raises for a malformed file: every problem is a finding on the returned header. Raises
    :class:`CkptctlError` only when the file cannot be read at all (missing, permission denied).
    """
    hdr, raw = read_header_bytes(path, display=display)
    if raw is not None:
        decode_header(hdr, raw, fast=fast)
    return hdr


def read_header_bytes(path: str | os.PathLike[str], *, display: str | None = None, follow: bool = True,
                      limit: int | None = None) -> tuple[Header, bytearray | None]:
    """The first half of :func:`read_header`: the file read up to the end of its header, and the
    checks that need no decoding (what the file is, the length field). Returns the header with
    those findings and the JSON bytes to decode (:func:`decode_header`), or None for them when a
    finding already makes the file unreadable. ``follow=False``: a link is not opened (OSError);
    ``limit``: a header longer than that is not read (None for its bytes, no finding; its length
    is ``header_len``)."""
    p = os.fspath(path)
    shown = display or p
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what it is. Read by
        # position, no file object: a header is read again at each use (163 three times in a repair).
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                hdr = Header(path=shown, file_size=0)
                hdr.add("header.not_a_file", f"{shown} is not a regular file (a FIFO, device or directory)",
                        hint="replace it with the real shard")
                return hdr, None
            size = st.st_size
            hdr = Header(path=shown, file_size=size)
            prefix = bytearray(min(size, 512))
            del prefix[_pread_into(fd, prefix, 0):]
            n = _check_prefix(hdr, bytes(prefix))
            if n is None or (limit is not None and n > limit):
                return hdr, None
            if n <= len(prefix) - 8:
                raw, got = prefix[8:8 + n], n
            else:
                raw = bytearray(n)
                got = _pread_into(fd, raw, 8)
        finally:
            os.close(fd)
    except OSError as exc:
        raise from_oserror(exc, "cannot read safetensors file") from None
    if got != n:  # the file shrank while we read it
        hdr.add("header.length_exceeds_file",
                f"{shown}: header length {n} runs past the end of the file (it changed while being read)",
                hint=REDOWNLOAD, header_len=n)
        return hdr, None
    return hdr, raw


def _pread_into(fd: int, buf: bytearray, offset: int) -> int:
    """Fill ``buf`` from ``offset`` of ``fd`` (a short read is read on from where it stopped);
    how many bytes it holds, fewer only at the end of the file."""
    got = 0
    with memoryview(buf) as view:
        while got < len(buf):
            k = os.preadv(fd, [view[got:]], offset + got)
            if not k:
                break
            got += k
    return got


def decode_header(hdr: Header, raw: bytearray, *, fast: bool = True, keep: bool = False) -> None:
    """The second half of :func:`read_header`: decode and check the JSON bytes ``raw`` of the header
    ``hdr``, emptied once decoded unless kept (``keep``: a reading compares them with later reads)."""
    _parse_into(hdr, raw, fast, keep)


def parse_header_bytes(data: bytes, *, path: str = "<bytes>", fast: bool = True) -> Header:
    """Validate a whole in-memory safetensors file (used by tests and fuzzing); the same checks
    and findings as :func:`read_header`."""
    hdr = Header(path=path, file_size=len(data))
    n = _check_prefix(hdr, data[:512])
    if n is None:
        return hdr
    _parse_into(hdr, bytearray(memoryview(data)[8:8 + n]), fast)
    return hdr


def load_header(path: str | os.PathLike[str], *, display: str | None = None, fast: bool = True) -> Header:
    """Read a header and raise :class:`InputError` (listing every error) if it is invalid."""
    return checked(read_header(path, display=display, fast=fast))


def checked(hdr: Header) -> Header:
    """``hdr``, or :class:`InputError` (listing every error) if it is invalid."""
    errors = [f for f in hdr.findings if f.severity == ERROR]
    if errors:
        first = errors[0]
        more = f" (+{len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise InputError(f"{first.message} [{first.code}]{more}",
                         first.hint or f"run `ckptctl verify {hdr.path}` for every problem")
    return hdr


def _parse_into(hdr: Header, raw: bytearray, fast: bool, keep: bool = False) -> None:
    """Decode and check the header bytes (``fast``: the typed decoder first); ``raw`` as :func:`decode_header`."""
    with paused():
        if fast:  # imported with msgspec where a header is first decoded: a command that decodes none pays neither
            from ckptctl.format import header_fast

            found = header_fast.decode(raw)
        else:
            found = None
        if found is None:
            _parse_text(hdr, raw, keep)
            return
        if not keep:
            del raw[:]
        # what the strict reader would find in this header: no finding of its own, then the
        # shared rules on the same metadata and table
        check_metadata(hdr, found.metadata)
        validate_layout(hdr, found.table)


def _parse_text(hdr: Header, raw: bytearray, keep: bool = False) -> None:
    """The strict reader (the reference): the text walked entry by entry, each value read by
    ``json``'s scanner with serde_json's rules."""
    shown = hdr.path
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        hdr.add("header.not_utf8", f"{shown}: header is not valid UTF-8 (byte {exc.start + 8})",
                hint=REDOWNLOAD, position=exc.start + 8)
        return
    if not keep:
        del raw[:]
    stripped = text.lstrip(" \t\r\n")
    if not stripped.startswith("{"):
        hdr.add("header.not_object", f"{shown}: header does not start with '{{'", hint=REDOWNLOAD)
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
        hdr.add("header.bad_json", f"{shown}: header is not valid JSON: {msg}", hint=REDOWNLOAD)
        return
    # Entries of the usual shape hold nothing serde_json refuses (depth 3, no escape in a known
    # dtype), and each top-level key was checked as it was read: the walk visits only the rest.
    problem = doc.top_problem or _serde_problem({name: value for _, name, value in doc.rest})
    if problem:
        hdr.add("header.bad_json", f"{shown}: header is not valid JSON for safetensors: {problem}",
                hint=REDOWNLOAD)
        return
    check_padding(hdr, padding)
    check_metadata(hdr, doc.meta)
    for row, name, value in doc.rest:
        if row is not None:
            cols.put(row, check_entry(hdr, name, value))
    validate_layout(hdr, cols.table())


_WS = re.compile(r"[ \t\n\r]*")  # the JSON parser's whitespace


@dataclass
class _Doc:
    """What reading the top-level object found besides the tensor columns."""

    end: int = 0  # just past the closing brace
    meta_present: bool = False
    meta: Any = None
    # entries that are not plain tensors, with their row (None: __metadata__), for the serde walk
    # and check_entry, in document order
    rest: list[tuple[int | None, str, Any]] = field(default_factory=list)
    top_problem: str | None = None  # the first lone surrogate in a top-level key or string value


class _Columns(Rows):
    """The tensors as the header lists them, one compact row each; a repeated name (or
    ``__metadata__``) is found once the object is read."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata_repeat: int | None = None  # rows read before a second __metadata__

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

    def entry(self, doc: _Doc, name: str, value: Any) -> None:
        """One entry as the JSON parser read it."""
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


def _surrogate(s: str) -> str | None:
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return f"lone surrogate escape in string {s[:40]!r}"
    return None


def _plain(entry: Any) -> tuple[str, int, int, tuple[int, ...]] | None:
    """(dtype, begin, end, shape) of an entry :func:`check_entry` would accept without a finding,
    found with exact type checks (a row, with no dict kept for the entry); None for anything
    else (an unknown key or dtype, a size that does not match), which is left to
    :func:`check_entry`."""
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
        if type(x) is not int or x < 0:
            return None
        numel *= x
        if numel > MAX_DIM_PRODUCT:  # checked at each step, as check_entry does ([2**49, 0] overflows)
            return None
    bits = numel * dt.BY_NAME[dtype].bits
    if not bits % 8 and end - begin == bits >> 3:
        return dtype, begin, end, tuple(shape)
    return None


def _scan_value(text: str, pos: int) -> tuple[Any, int]:
    """One JSON value at ``pos`` with serde_json's rules. Read first with Python's own int
    parser (``_FAST``); a failure (an integer over Python's digit limit, bad JSON) is decided
    again by ``_STRICT``, which names the problem, and so is a value whose text holds a ``-0``
    (``_FAST`` reads a negative zero as 0: only ``_STRICT`` tells them apart)."""
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
    each tensor entry as a row of ``cols`` instead of a dict where it can."""
    doc = _Doc()
    n, ws = len(text), _WS.match
    pos = ws(text, 1).end()
    if pos < n and text[pos] == "}":
        doc.end = pos + 1
        return doc
    while True:
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

