"""The fast index reader: msgspec into a typed record, where it provably reads what ``json.loads``
with ``no_duplicate_keys`` (the reference, :func:`ckptctl.format.index.parse_index`) reads.

Imported only where it runs (msgspec's import is about 7 ms): :func:`load` returns the
document as json would read it, or None, and json then reads the text. None where:

- msgspec refuses the text: invalid JSON, bytes that are not UTF-8, a byte-order mark, a control
  character in a string, NaN or Infinity, a float out of range, a ``weight_map`` that is missing
  or does not map strings to strings;
- there is a backslash anywhere (an escape: below, every ``"`` must open or close a string);
- ``metadata`` holds a float or a 0 (msgspec reads ``-0`` as 0, json as the float -0.0) or nests
  past 64 levels;
- the text holds more strings than what was decoded (each key and string value counted, each
  opening and closing ``"``): a repeated key (msgspec keeps the last, json's hook refuses it), a
  top-level key other than ``weight_map`` and ``metadata`` (the record drops it), or a
  ``metadata`` of null (the record cannot tell it from none).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Index(msgspec.Struct):
    weight_map: dict[str, str]
    metadata: Any = None


_DECODER = msgspec.json.Decoder(_Index)
# a decoder whose values are one of given names is made for at most this many of them
MAX_VALUES = 4096


def load(raw: bytes, values: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The index document ``raw`` as json reads it, or None where that is not proven.

    ``values``: the names its shards probably have (the files of its folder). Each ``weight_map``
    value that is one of them is then decoded as that very string (a ``Literal``, as a header's
    dtypes are): one string per shard, not one per tensor (an index of 94k names: 2,100 fewer
    pages, and the shards' set made from 163 strings' cached hashes). A value that is none of them
    decodes the text again with plain strings: the same document either way."""
    if b"\\" in raw:
        return None
    doc = None
    if values and len(values) <= MAX_VALUES:
        named = msgspec.defstruct("_Index", [("weight_map", dict[str, Literal[values]]), ("metadata", Any, None)])
        try:
            doc = msgspec.json.Decoder(named).decode(raw)
        except msgspec.DecodeError:  # (ValidationError is one: a value of another name, or anything)
            doc = None
    try:
        doc = doc if doc is not None else _DECODER.decode(raw)
    except msgspec.DecodeError:  # (ValidationError is one)
        return None
    wm, meta = doc.weight_map, doc.metadata
    strings = 1 + 2 * len(wm)  # the weight_map key, each name and shard
    out: dict[str, Any] = {"weight_map": wm}  # (the keys in this order: what reads it looks them up)
    if meta is not None:
        more = strings_in(meta, 1)
        if more is None:
            return None
        strings += 1 + more
        out["metadata"] = meta
    return out if raw.count(b'"') == 2 * strings else None


def strings_in(value: Any, depth: int) -> int | None:
    """The strings (keys and values) in ``value``; None for what json may read otherwise."""
    if type(value) is str:
        return 1
    if value is None or type(value) is bool or (type(value) is int and value != 0):
        return 0
    if depth > 64 or type(value) not in (dict, list):
        return None  # a float, a 0 (perhaps -0), deep nesting
    total = len(value) if type(value) is dict else 0
    for item in (value.values() if type(value) is dict else value):
        got = strings_in(item, depth + 1)
        if got is None:
            return None
        total += got
    return total
