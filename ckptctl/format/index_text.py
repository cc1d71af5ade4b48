"""An index's ``weight_map`` cut from its bytes, for the worker of a split (``layout.prefetch``).

The worker hands back each shard's names, sorted and joined by newlines (``Index.joins``), not a
dict of every entry. Where the index is written the way its writers write it (every entry
``"name": "shard"`` with the same separators, no escape, names sorted or not), those joins
come from the bytes directly: one regular expression takes each run of entries that name the
same shard, a second the names of the run, and each shard's names are decoded once, joined. It
makes a bytes object per name and nothing else per entry (no dict, no shard string per entry),
41 ms against 60-66 ms for reading, parsing and grouping DeepSeek-V3's 92k entries, in a fresh
process (the mapping also spares the copy of the file's 8.8 MB).

What :func:`joins_of` returns is exactly what ``json.loads`` with ``no_duplicate_keys`` reads,
grouped as ``format.index`` groups it, because it returns only where all of this holds:

* no backslash anywhere: every ``"`` opens or closes a string, and no string holds one;
* ``"weight_map"`` occurs once; after it come ``:`` and an object whose members tile it exactly:
  ``"K" KV "V"``, one SEP between members, KV and SEP (JSON whitespace around ``:`` and ``,``) the
  same text throughout, both taken from the first two members;
* no control character (U+0000-U+001F, which json refuses in a string) in a name or a shard;
* every name and shard is UTF-8 (decoded strictly);
* no name repeats (json's hook would refuse the index): the names are strictly increasing as
  bytes (transformers sorts them), or as many as their set; each shard's are then sorted as bytes,
  which is ``sorted``'s order of the names (UTF-8 orders bytes as it orders code points);
* the rest of the text, with that object emptied to ``{}``, is read by ``json.loads`` with the same
  hook, and its top-level ``weight_map`` is that ``{}``: the object was the top-level weight_map
  (its key occurs once), and putting one JSON value in another's place keeps the text valid.

Anything else gives None, and the caller reads the file with json (its findings come from there).
"""

from __future__ import annotations

import json
import re
from itertools import chain, islice
from operator import lt
from typing import Any

from ckptctl.format.header import DuplicateKey, no_duplicate_keys

_WS = rb"[ \t\n\r]*"  # JSON's whitespace
_KEY = b'"weight_map"'
_OPEN = re.compile(_KEY + _WS + b":" + _WS + rb"(\{)" + _WS + b'"')  # up to the first name's quote
_FIRST = re.compile(rb'"[^"]*"(' + _WS + b":" + _WS + rb')"[^"]*"(' + _WS + b"," + _WS + rb')"')
_CLOSE = re.compile(_WS + rb"\}")
_CONTROL = bytes(range(32))

Buffer = Any  # bytes, or an mmap of the file (``find`` and slicing are all this module asks of it)


def _patterns(kv: bytes, sep: bytes) -> tuple[Any, Any]:
    """A run of members naming one shard (the shard captured), and a member's name (the run's
    names, in order, by ``findall`` over the run)."""
    k, s = re.escape(kv), re.escape(sep)
    run = re.compile(b'"[^"]*"' + k + b'"([^"]*)"(?:' + s + b'"[^"]*"' + k + rb'"\1")*')
    member = re.compile(b'"([^"]*)"' + k + b'"[^"]*"')
    return run.match, member.findall


def joins_of(buf: Buffer) -> tuple[dict[str, Any], dict[str, str]] | None:
    """(the index with its weight_map emptied, each shard's names sorted and joined by newlines),
    or None where that cannot be said from the text as the module's docstring says."""
    if buf.find(b"\\") != -1:
        return None
    at = buf.find(_KEY)
    if at < 0 or buf.find(_KEY, at + 1) != -1:
        return None
    opened = _OPEN.match(buf, at)
    first = None if opened is None else _FIRST.match(buf, opened.end() - 1)
    if opened is None or first is None:
        return None  # not an object of strings, or of one member only
    brace, pos = opened.start(1), opened.end() - 1
    sep = first.group(2)
    run, names_in = _patterns(first.group(1), sep)
    step = len(sep)
    found: list[tuple[bytes, list[bytes]]] = []
    while True:
        m = run(buf, pos)
        if m is None:
            return None
        end = m.end()
        found.append((m.group(1), names_in(buf, pos, end)))
        if buf[end:end + step] != sep or buf[end + step:end + step + 1] != b'"':
            break
        pos = end + step
    closed = _CLOSE.match(buf, end)
    if closed is None:
        return None
    names = list(chain.from_iterable(keys for _, keys in found))
    ordered = all(map(lt, names, islice(names, 1, None)))
    if not ordered and len(set(names)) != len(names):  # (huggingface_hub keeps the state dict's order)
        return None  # a repeated name: json refuses the index
    groups: dict[bytes, list[bytes]] = {}
    for shard, keys in found:  # (the first run's list of a shard takes the others': names is made)
        got = groups.get(shard)
        if got is None:
            groups[shard] = keys
        else:
            got.extend(keys)
    if not ordered:
        for keys in groups.values():
            keys.sort()
    joins: dict[str, str] = {}
    try:
        for shard, keys in groups.items():
            text = b"\n".join(keys)
            # the only control characters: the newlines put between the names
            if len(text.translate(None, _CONTROL)) != len(text) - len(keys) + 1 or shard.translate(None, _CONTROL) != shard:
                return None
            joins[shard.decode("utf-8")] = text.decode("utf-8")
        rest = bytes(buf[:brace + 1]) + b"}" + bytes(buf[closed.end():])
        doc = json.loads(rest.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError, DuplicateKey):  # bad UTF-8 or JSON, an int over 4300 digits
        return None
    # the key occurs once: a top-level weight_map is the one emptied, and none means it was nested
    if type(doc) is not dict or type(doc.get("weight_map")) is not dict:
        return None
    return doc, joins
