"""The fast header decoder: msgspec into typed records, then proofs that the strict reader
(:mod:`ckptctl.format.header`, the reference) reads the same header the same way.

:func:`decode` gives the tensor table and the metadata only for a header in which the strict
reader finds nothing of its own: valid JSON that serde_json reads, no repeated key, only spaces
after the object, every entry exactly ``dtype`` (a known one), ``shape`` and ``data_offsets``
with the size they imply. The shared rules (:mod:`ckptctl.format.header_rules`) then find the
rest from the table and the metadata, as they do for the strict reader. For anything else it
returns None and the strict reader runs.

What msgspec lets through that the strict reader refuses, and the proof used for each:

- a repeated key (msgspec keeps the last): each piece of the text holds exactly 4 colons per
  entry it decoded to (a key, three fields), and the names of all pieces are distinct;
- ``-0`` (msgspec: 0; serde_json: the float -0.0, not a size): where a piece holds a 0 (a
  begin offset, a zero-size shape), no sign in an array of its text;
- ``__metadata__``: only as the first key, an object of strings whose pair count is checked the
  same way; a tensor entry of that name falls back;
- negative or huge dimensions and offsets: per (dtype, shape) kind, as the strict reader checks
  an entry, and by the ``array("Q")`` the offsets go into (below 0 or from 2**64: fallback).

msgspec itself refuses the rest: floats and bools where an int belongs, leading zeros, unknown
or missing fields, lone surrogate escapes, bytes that are not UTF-8, any other JSON error.
Leading whitespace and a byte-order mark fall back (the header must begin with ``{``).
"""

from __future__ import annotations

import operator
import re
from array import array
from dataclasses import dataclass
from typing import Literal

import msgspec

from ckptctl.format import dtypes as dt
from ckptctl.format.header_rules import MAX_DIM_PRODUCT, METADATA_KEY
from ckptctl.format.table import Rows, TensorTable

# a known dtype, or a validation error: each decoded dtype is the one shared string
_Dtype = Literal[tuple(d.name for d in dt.DTYPES)]  # type: ignore[valid-type]


class _Entry(msgspec.Struct, gc=False, forbid_unknown_fields=True):  # (the colon count proves it too)
    dtype: _Dtype
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


_ENTRIES = msgspec.json.Decoder(dict[str, _Entry])
_METADATA = msgspec.json.Decoder(dict[str, str])

_STRING = rb'"(?:[^"\\]|\\.)*+"'
# the header's first key: __metadata__, an object of strings (group 1), then what follows it
# (W: JSON's whitespace)
_META_FIRST = re.compile(rb'\{W"__metadata__"W:W(\{W(?:SW:WSW(?:,WSW:WSW)*)?\})W([,}])'
                         .replace(b"S", _STRING).replace(b"W", rb"[ \t\n\r]*+"))
_STRINGS = re.compile(_STRING)
_SIGNED = re.compile(rb"[\[,][ \t\n\r]*-")  # a number in an array with a sign
_COLONS_PER_ENTRY = 4  # "name":{"dtype":..,"shape":..,"data_offsets":..}

# bytes of entries decoded at once: a piece's records are made into columns and dropped before
# the next (a 90 MB header as one dict of records would cost about 800 MiB)
CHUNK = 1 << 18

_DTYPE, _SHAPE, _OFFSETS = (operator.attrgetter(a) for a in ("dtype", "shape", "data_offsets"))
_BEGIN, _END = operator.itemgetter(0), operator.itemgetter(1)


@dataclass
class Decoded:
    """A header as the strict reader would read it: its tensors and its ``__metadata__`` (None
    when it has none)."""

    table: TensorTable
    metadata: dict[str, str] | None


class _Refused(Exception):
    """A (dtype, shape) the strict reader gives a finding for."""


class _Kinds(dict):  # type: ignore[type-arg]
    """(dtype, shape) -> kind code of ``rows``; each new kind is checked once, as
    :func:`~ckptctl.format.header_rules.check_entry` checks an entry's shape and dtype."""

    def __init__(self, rows: Rows) -> None:
        super().__init__()
        self.rows = rows
        self.sizes: list[int] = []  # bytes, by kind code

    def __missing__(self, key: tuple[str, tuple[int, ...]]) -> int:
        dtype, shape = key
        numel = 1
        for x in shape:
            if x < 0:
                raise _Refused
            numel *= x
            if numel > MAX_DIM_PRODUCT:
                raise _Refused
        bits = numel * dt.BY_NAME[dtype].bits
        if bits % 8:
            raise _Refused
        code = self[key] = len(self.sizes)
        self.sizes.append(bits >> 3)
        self.rows.kinds.append(key)
        return code


def decode(raw: bytes | bytearray, *, chunk: int = CHUNK) -> Decoded | None:
    """The header text ``raw`` (without its length field) read as the strict reader reads it,
    or None where that is not proven."""
    if raw[:1] != b"{":
        return None
    close = raw.rfind(b"}")
    if close < 0 or raw.count(b" ", close + 1) != len(raw) - close - 1:
        return None  # something other than spaces after the object (or no object)
    start, metadata, entries_follow = 1, None, False
    first = _META_FIRST.match(raw)
    if first is not None:
        text = first.group(1)
        try:
            metadata = _METADATA.decode(text)
        except msgspec.DecodeError:
            return None
        if 2 * len(metadata) != len(_STRINGS.findall(text)):
            return None  # a repeated key
        start, entries_follow = first.end(), first.group(2) == b","
        if not entries_follow and start - 1 != close:
            return None
    rows = Rows()
    kinds = _Kinds(rows)
    view = memoryview(raw)
    pos, pieces = start, 0
    try:
        while pos < close:  # pieces cut after a "}," (a cut inside a string leaves it open: an error)
            cut = raw.find(b"},", pos + chunk, close)
            stop = close if cut < 0 else cut + 1
            count = _add(rows, kinds, b"".join((b"{", view[pos:stop], b"}")))
            pieces += 1
            if count < 0 or not count and pos != start:
                return None  # (a piece after a comma holds an entry at least)
            pos = stop + 1
            if pos == close:
                return None  # a comma, then the closing brace
    except (msgspec.DecodeError, _Refused, OverflowError):  # OverflowError: an offset < 0 or >= 2**64
        return None
    finally:
        view.release()
    names = rows.names
    if entries_follow and not names:
        return None  # a comma after the metadata, then nothing
    if pieces > 1 and len(set(names)) != len(names):
        return None  # a name in two pieces (the table's look-up by name is made when first asked)
    begin, end = rows.begin, rows.end
    rows.chained = 0 not in kinds.sizes and (not names or begin[0] == 0) and begin[1:] == end[:-1]
    return Decoded(rows.table(), metadata)


def _add(rows: Rows, kinds: _Kinds, piece: bytes) -> int:
    """The entries of one piece (an object) appended to ``rows`` by column; how many, or -1
    when they cannot be proven to be what the strict reader reads."""
    entries = _ENTRIES.decode(piece)
    if piece.count(b":") != _COLONS_PER_ENTRY * len(entries) or METADATA_KEY in entries:
        return -1
    values = entries.values()
    kind = array("I", map(kinds.__getitem__, zip(map(_DTYPE, values), map(_SHAPE, values))))
    offsets = list(map(_OFFSETS, values))
    begin, end = array("Q", map(_BEGIN, offsets)), array("Q", map(_END, offsets))
    if not all(map(operator.eq, map(operator.sub, end, begin), map(kinds.sizes.__getitem__, kind))):
        return -1
    # a "-0" reads as 0: a 0 sits only in a begin (an end of 0 has a begin of 0) or in the shape
    # of a kind of 0 bytes; only then is the text searched for a sign (names may hold dashes)
    if (0 in begin or 0 in kinds.sizes) and b"-" in piece and _SIGNED.search(piece):
        return -1
    rows.names.extend(entries)
    rows.begin.extend(begin)
    rows.end.extend(end)
    rows.kind.extend(kind)
    return len(kind)
