"""The worker's reading of an index from its text (``format.index_text``) against json's.

Wherever ``joins_of`` answers, its answer must be what ``json.loads`` (with the duplicate-key hook)
reads, grouped as ``format.index._joins`` groups it; where json refuses the text, or reads it
otherwise, it must not answer. The texts are written by hand (no escaping), so that names with
quotes, backslashes, control characters, repeats, disorder and odd separators reach it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from huggingface_hub import save_torch_state_dict

from ckptctl.format import index as I
from ckptctl.format.header import DuplicateKey, no_duplicate_keys
from ckptctl.format.index_text import joins_of


def reference(raw: bytes):
    """What the json path reads: (the document with its weight_map emptied, the joins), or None
    where it refuses the text."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError, DuplicateKey):
        return None
    if not isinstance(obj, dict):
        return None
    wm = obj.get("weight_map")
    if not isinstance(wm, dict) or not wm or not all(type(v) is str for v in wm.values()):
        return None
    return {**obj, "weight_map": {}}, I._joins(wm)


def text_of(members: list[tuple[str, str]], *, kv: str = ": ", sep: str = ",\n    ", before: str = "",
            after: str = "", open_ws: str = "\n    ", close_ws: str = "\n  ") -> bytes:
    """An index written by hand: no escaping of the names, whatever they hold."""
    body = sep.join(f'"{k}"{kv}"{v}"' for k, v in members)
    return f'{{{before}"weight_map": {{{open_ws}{body}{close_ws}}}{after}}}\n'.encode("utf-8", "surrogatepass")


def check(raw: bytes) -> object:
    got, ref = joins_of(raw), reference(raw)
    if got is not None:
        assert ref is not None, raw[:300]
        assert got == ref, raw[:300]
    return got


SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "m\u00e9-3.safetensors"]


def test_the_writers_texts_are_read_from_the_text(tmp_path: Path) -> None:
    names = [f"model.layers.{i}.mlp.experts.{j}.down_proj.weight" for i in range(12) for j in range(20)]
    wm = {n: SHARDS[k % 2] for k, n in enumerate(sorted(names))}
    wide = {n: SHARDS[k % 3] for k, n in enumerate(sorted(names))}  # a shard name beyond ASCII, unescaped
    texts = [I.encode_index(wm, 10, total_parameters=5),  # transformers' format: indent 2, sorted
             json.dumps({"metadata": {"total_size": 10}, "weight_map": wm}).encode(),  # default separators
             json.dumps({"weight_map": wm, "metadata": {"total_size": 10}}, indent="\t").encode(),
             json.dumps({"metadata": {}, "weight_map": wide}, separators=(",", ":"), ensure_ascii=False).encode()]
    for raw, wm in zip(texts, [wm, wm, wm, wide]):
        got = check(raw)
        assert got is not None, raw[:200]
        assert got[1] == I._joins(wm)
    # huggingface_hub's own writer (the state dict's order, not sorted)
    save_torch_state_dict({n: torch.zeros(2) for n in names}, tmp_path, max_shard_size=400)
    raw = (tmp_path / "model.safetensors.index.json").read_bytes()
    assert check(raw) is not None


@pytest.mark.parametrize("raw", [
    text_of([("a", SHARDS[0]), ("a", SHARDS[1])]),  # a repeated name: json refuses it
    text_of([("a", SHARDS[0]), ("a", SHARDS[0])]),
    text_of([("a\tb", SHARDS[0]), ("c", SHARDS[0])]),  # a control character in a name
    text_of([("a\nb", SHARDS[0]), ("c", SHARDS[0])]),
    text_of([("a", "s\x01"), ("c", "s\x01")]),  # ... in a shard
    text_of([("a\\u0041", SHARDS[0]), ("c", SHARDS[0])]),  # an escape
    text_of([("a", SHARDS[0])]),  # one member
    text_of([("a", SHARDS[0]), ("b", SHARDS[0])], before='"metadata": {"weight_map": 1}, '),  # the key twice
    text_of([("a", SHARDS[0]), ("b", SHARDS[0])], after=', "weight_map": {}'),
    text_of([("a", SHARDS[0]), ("b", SHARDS[0]), ("c", SHARDS[1])], sep=", ", kv=": ").replace(b', "c"', b',"c"'),
    text_of([("a", SHARDS[0]), ("b", SHARDS[0])], after=', "metadata": {"x": 1, "x": 2}'),
    text_of([("a", SHARDS[0]), ("b", SHARDS[0])]) + b"garbage",
    b"\xef\xbb\xbf" + text_of([("a", SHARDS[0]), ("b", SHARDS[0])]),  # a BOM
    text_of([("a\udcff", SHARDS[0]), ("b", SHARDS[0])]),  # not UTF-8
    b'{"metadata": {"weight_map": {"a": "x", "b": "x"}}}',  # a nested weight_map, no top-level one
    b'{"metadata": {"weight_map": {"a": "x", "b": "x"}}, "weight_map": {}}',  # ... and an empty one after it
    b'["weight_map": {"a": "x", "b": "x"}]',
], ids=lambda raw: raw[:40].decode("utf-8", "replace"))
def test_what_the_text_cannot_tell_is_left_to_json(raw: bytes) -> None:
    assert joins_of(raw) is None
    check(raw)


# names that may be read from the text, and (one per text, sometimes) names that may not: a quote,
# a backslash, a control character, the key itself
_NAME = st.lists(st.sampled_from(list("ab.0 :,{}[]\u00e9\U0001f600") + ["weight_map"]), max_size=6).map("".join)
_HOSTILE = st.lists(st.sampled_from(list('a"\\\t\n\x00') + ['"weight_map"', "\\u00e9"]), min_size=1,
                    max_size=4).map("".join)
_SHARD = st.sampled_from(SHARDS)


@st.composite
def _members(draw) -> list[tuple[str, str]]:
    members = draw(st.lists(st.tuples(_NAME, _SHARD), min_size=1, max_size=12, unique_by=lambda m: m[0]))
    if draw(st.booleans()):
        members = sorted(members)  # transformers' order
    k = draw(st.integers(0, len(members) - 1))
    change = draw(st.integers(0, 7))
    if change == 0:  # a repeated name, to the same shard or another
        members.insert(draw(st.integers(0, len(members))), (members[k][0], draw(_SHARD)))
    elif change == 1:
        members[k] = (draw(_HOSTILE), members[k][1])
    elif change == 2:  # a shard name json refuses, or reads otherwise
        members[k] = (members[k][0], draw(st.sampled_from(['x"y', "s\\", "", "t\x1f", "\u00e9\\u00e9"])))
    return members


@settings(max_examples=500, deadline=None)
@given(members=_members(),
       kv=st.sampled_from([": ", ":", " : ", ":\n", "\t:\r"]),
       sep=st.sampled_from([", ", ",", ",\n    ", " ,\n\t", "\n,"]),
       before=st.sampled_from(["", "", '"metadata": {"total_size": 3}, ', '"metadata": null, ', '"metadata": [],\n  ',
                               '"metadata": {"weight_map": {"a": "b"}}, ', '"x": -0, "y": 1.5, ']),
       after=st.sampled_from(["", "", "", "", ', "extra": {"total_size": 1}', ', "metadata": {"x": 1', ',']))
def test_the_text_reads_what_json_reads(members, kv, sep, before, after) -> None:
    check(text_of(members, kv=kv, sep=sep, before=before, after=after))


def test_a_file_read_for_the_worker_is_the_same_either_way(tmp_path: Path) -> None:
    wm = {f"t.{i:04d}": SHARDS[i * 7 % 3] for i in range(500)}
    p = tmp_path / "model.safetensors.index.json"
    p.write_bytes(I.encode_index(wm, 48))
    doc = I.read_for_worker(str(p), "shown")
    assert doc.joins == I._joins(wm) and doc.shards == sorted(SHARDS) and doc.metadata == {"total_size": 48}
    assert doc.weight_map == wm
    # out of order, and then with an escape (read by json): the same result
    for text in (json.dumps({"metadata": {"total_size": 48}, "weight_map": dict(reversed(wm.items()))}),
                 json.dumps({"metadata": {"total_size": 48, "x": "\u00e9"}, "weight_map": wm})):
        p.write_text(text)
        again = I.read_for_worker(str(p), "shown")
        assert (again.joins, again.shards, again.findings) == (doc.joins, doc.shards, [])
