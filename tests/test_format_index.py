"""``*.safetensors.index.json``: reading (one finding per problem) and encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from huggingface_hub import save_torch_state_dict

from ckptctl.errors import OperationalError
from ckptctl.findings import ERROR
from ckptctl.format.index import MAX_INDEX_SIZE, encode_index, read_index


def write(tmp_path: Path, content: bytes | str | dict, name: str = "model.safetensors.index.json") -> Path:
    p = tmp_path / name
    if isinstance(content, dict):
        content = json.dumps(content)
    p.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return p


def codes(idx) -> list[str]:
    return [f.code for f in idx.findings]


GOOD = {"metadata": {"total_size": 12}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                       "b": "model-00002-of-00002.safetensors",
                                                       "c": "model-00001-of-00002.safetensors"}}


def test_valid_index(tmp_path: Path) -> None:
    idx = read_index(write(tmp_path, GOOD), display="shown.json")
    assert idx.ok and idx.findings == []
    assert idx.path == "shown.json"
    assert idx.weight_map == GOOD["weight_map"]
    assert idx.metadata == {"total_size": 12}
    assert idx.shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("content", [b'{"weight_map": {', b"", b"\xff\xfe{}", b"{'single': 'quotes'}",
                                     b'{"weight_map": {}} trailing', b"[" * 100_000,
                                     b'{"metadata": {"total_size": ' + b"9" * 5000 + b'}, "weight_map": {}}'])
def test_bad_json(tmp_path: Path, content: bytes) -> None:
    idx = read_index(write(tmp_path, content))
    assert codes(idx) == ["index.bad_json"]
    assert not idx.ok and idx.findings[0].severity == ERROR and idx.findings[0].hint


def test_duplicate_top_level_key(tmp_path: Path) -> None:
    text = '{"metadata": {}, "weight_map": {"a": "x.safetensors"}, "weight_map": {"b": "y.safetensors"}}'
    idx = read_index(write(tmp_path, text))
    assert codes(idx) == ["index.duplicate_key"]
    assert idx.findings[0].tensor == "weight_map"


def test_duplicate_tensor_in_weight_map(tmp_path: Path) -> None:
    text = '{"metadata": {}, "weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}'
    idx = read_index(write(tmp_path, text))
    assert codes(idx) == ["index.duplicate_key"]
    assert idx.findings[0].tensor == "a"
    assert idx.weight_map == {}  # nothing is trusted from an ambiguous index


@pytest.mark.parametrize("doc", [
    {"metadata": {}},
    {"metadata": {}, "weight_map": None},
    {"metadata": {}, "weight_map": ["a"]},
    {"metadata": {}, "weight_map": {"a": 1}},
    {"metadata": {}, "weight_map": {"a": ["x.safetensors"]}},
    [],
    "weight_map",
])
def test_missing_or_bad_weight_map(tmp_path: Path, doc) -> None:
    idx = read_index(write(tmp_path, json.dumps(doc)))
    assert codes(idx) == ["index.bad_schema"]


def test_missing_metadata(tmp_path: Path) -> None:
    idx = read_index(write(tmp_path, {"weight_map": {"a": "x.safetensors"}}))
    assert codes(idx) == ["index.no_metadata"]
    assert idx.weight_map == {"a": "x.safetensors"}  # the map itself is still usable


def test_metadata_not_object(tmp_path: Path) -> None:
    idx = read_index(write(tmp_path, {"metadata": "x", "weight_map": {}}))
    assert codes(idx) == ["index.bad_schema"]


def test_too_large_is_refused_without_reading(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors.index.json"
    with open(p, "wb") as f:
        f.truncate(MAX_INDEX_SIZE + 1)  # sparse: refused from its size alone
    idx = read_index(p)
    assert codes(idx) == ["index.too_large"]
    with open(p, "r+b") as f:
        f.truncate(MAX_INDEX_SIZE)
    assert codes(read_index(p)) == ["index.bad_json"]  # at the limit it is read (and is NULs)


def test_missing_file_raises(tmp_path: Path) -> None:
    # missing when it is read: it vanished mid-operation, an I/O failure, exit 3 (issue 15)
    with pytest.raises(OperationalError) as err:
        read_index(tmp_path / "absent.index.json")
    assert err.value.exit_code == 3 and "no such file or directory" in err.value.message


def test_encode_round_trip(tmp_path: Path) -> None:
    wm = {"z": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"}
    raw = encode_index(wm, 100, total_parameters=25, extra_metadata={"format": "pt"})
    assert raw.endswith(b"}\n")
    doc = json.loads(raw)
    assert list(doc) == ["metadata", "weight_map"]
    assert list(doc["weight_map"]) == ["a", "z"]
    assert doc["metadata"] == {"format": "pt", "total_parameters": 25, "total_size": 100}
    idx = read_index(write(tmp_path, raw))
    assert idx.ok and idx.weight_map == wm


def test_reads_huggingface_hub_index(tmp_path: Path) -> None:
    sd = {f"layer.{i}.weight": torch.full((64,), float(i)) for i in range(6)}
    save_torch_state_dict(sd, tmp_path, max_shard_size=600)
    idx = read_index(tmp_path / "model.safetensors.index.json")
    assert idx.ok and idx.findings == []
    assert set(idx.weight_map) == set(sd)
    assert len(idx.shards) > 1
    assert all((tmp_path / s).is_file() for s in idx.shards)
    assert idx.metadata["total_size"] == 6 * 64 * 4


def test_an_index_that_became_a_fifo_is_a_finding_not_a_wait(tmp_path) -> None:
    """layout checks that the index is a regular file before reading it; one replaced by a FIFO
    in between is opened without blocking and refused."""
    import os

    from ckptctl.format.index import read_index

    fifo = tmp_path / "model.safetensors.index.json"
    os.mkfifo(fifo)
    idx = read_index(fifo)
    assert [f.code for f in idx.findings] == ["index.bad_json"]
    assert "not a regular file" in idx.findings[0].message and not idx.ok


# --------------------------------------------------------------------------------------------
# the msgspec reading: what json reads, or nothing (json then reads the text)

_texts = st.text(st.sampled_from('ab-0.é"\\\n'), max_size=5)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 1e300, 2**70, -2**70]),
                     _texts)
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(_texts, inner, max_size=3)), max_leaves=8)


def _index_text(doc: dict, dup: str | None, spaced: bool) -> bytes:
    """``doc`` as JSON (indent 2), with a repeated weight_map key when ``dup``, and a space before
    every colon when ``spaced``."""
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    if dup is not None and '"weight_map": {\n' in text:
        text = text.replace('"weight_map": {\n', '"weight_map": {\n    ' + json.dumps(dup) + ': "x.safetensors",\n', 1)
    if spaced:
        text = text.replace('": ', '" : ')
    return text.encode()


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_texts, _texts, max_size=4), _values, st.one_of(st.none(), _texts), st.booleans(),
       st.booleans())
def test_the_msgspec_reading_is_json_s_or_none(weight_map, metadata, dup, spaced, negative_zero):
    """Escapes, repeated keys (also after a space before the colon), -0, floats, huge integers,
    nesting: where ``index_fast.load`` reads the text, json reads the same; where json refuses it
    or names a repeated key, ``index_fast.load`` declines."""
    from ckptctl.format.header import DuplicateKey, no_duplicate_keys
    from ckptctl.format.index_fast import load as _fast_load

    raw = _index_text({"metadata": metadata, "weight_map": weight_map}, dup, spaced)
    if negative_zero:
        raw = raw.replace(b'"metadata": ', b'"metadata": -0, "m": ', 1).replace(b'"metadata" : ', b'"metadata" : -0, "m" : ', 1)
    try:
        expected = json.loads(raw.decode(), object_pairs_hook=no_duplicate_keys)
    except (DuplicateKey, ValueError):
        expected = None
    got = _fast_load(raw)
    if got is not None:
        assert expected is not None and got == expected
        assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)  # the same types
        assert not negative_zero
    # told the names the values probably are (all of them, or one that may be none): the same
    for values in (tuple(sorted(set(weight_map.values()))), ("x.safetensors",)):
        named = _fast_load(raw, values)
        assert (named is None) == (got is None)
        if named is not None:
            assert json.dumps(named, sort_keys=True) == json.dumps(got, sort_keys=True)


def test_the_msgspec_reading_takes_a_written_index(tmp_path: Path) -> None:
    from ckptctl.format.index_fast import load as _fast_load

    raw = write(tmp_path, {"metadata": {"total_size": 12, "format": "pt"}, "weight_map": GOOD["weight_map"]}).read_bytes()
    assert _fast_load(raw) == json.loads(raw)
    # told its shards' names, each value is that very string; a name it does not hold: read anyway
    shards = tuple(sorted(set(GOOD["weight_map"].values())))
    named = _fast_load(raw, shards)
    assert named == json.loads(raw) and all(any(v is s for s in shards) for v in named["weight_map"].values())
    assert _fast_load(raw, shards[:1]) == json.loads(raw)
    repeated = raw.replace(b'{"a": ', b'{"c": "x", "a": ', 1)
    assert _fast_load(repeated) is None
    assert codes(read_index(write(tmp_path, repeated, "r.json"))) == ["index.duplicate_key"]


@pytest.mark.parametrize("raw", [
    b'\xef\xbb\xbf{"metadata": {}, "weight_map": {"a": "s.safetensors"}}',  # a byte-order mark
    b'{"metadata": {}, "weight_map": {"a\x01": "s.safetensors"}}',  # a control character in a name
    b'{"metadata": {}, "weight_map": {"\xc0\xaf": "s.safetensors"}}',  # an overlong UTF-8 form
    b'{"metadata": {}, "weight_map": {"\xed\xa0\x80": "s.safetensors"}}',  # a UTF-8-encoded surrogate
    b'{"metadata": {}, "weight_map": {"a": "s.safetensors"}} x',  # text after the object
    b'{"metadata": {"n": NaN}, "weight_map": {"a": "s.safetensors"}}',  # json reads NaN
    b'{"metadata": {"n": [1e400]}, "weight_map": {"a": "s.safetensors"}}',  # json reads inf
    b'{"metadata": null, "weight_map": {"a": "s.safetensors"}}',  # a null the record cannot tell from none
    b'{"metadata": {}, "weight_map": {"a": "s.safetensors"}, "extra": 1}',  # a key the record drops
    b'{"metadata": {}, "weight_map": {"a": 1}}',  # not strings to strings
    b'{"metadata": {}, "weight_map": {}, "weight_map": {"a": "s.safetensors"}}',  # weight_map twice
])
def test_the_msgspec_reading_declines_what_it_may_read_otherwise(tmp_path: Path, raw: bytes) -> None:
    """Byte-level cases the property test does not write: msgspec's reading declines each, and
    the index reads with the same findings whichever reader was asked first."""
    from ckptctl.format.index_fast import load

    assert load(raw) is None and load(raw, ("s.safetensors",)) is None
    p = write(tmp_path, raw)
    fast, reference = read_index(p, fast=True), read_index(p, fast=False)
    assert codes(fast) == codes(reference)
    assert fast.metadata == reference.metadata and fast.weight_map == reference.weight_map


def test_bytes_read_before_are_compared_with_the_file_and_returned_only_when_it_holds_them(tmp_path: Path) -> None:
    """``read_index_bytes(same_as=...)``: the very object read before when the file holds exactly
    its bytes (compared piece by piece, across several pieces here); the file's own bytes when
    one byte differs in the last piece, when it grew or shrank."""
    from ckptctl.format.index import Index, read_index_bytes

    weight_map = {f"model.layers.{i}.weight": f"model-{i % 3 + 1:05d}-of-00003.safetensors" for i in range(4000)}
    p = write(tmp_path, {"metadata": {"total_size": 8}, "weight_map": weight_map})
    first = read_index_bytes(str(p), Index(str(p)))
    assert first is not None and len(first) > 3 * (1 << 16)
    other = bytearray(first)
    other[-10] ^= 1
    other = bytes(other)  # the same size, another last piece
    assert read_index_bytes(str(p), Index(str(p)), same_as=[other, first]) is first
    assert read_index_bytes(str(p), Index(str(p)), same_as=[other]) == first
    p.write_bytes(other)
    again = read_index_bytes(str(p), Index(str(p)), same_as=[first])
    assert again == other and again is not first
    p.write_bytes(first + b" ")
    assert read_index_bytes(str(p), Index(str(p)), same_as=[first]) == first + b" "
    p.write_bytes(first[:-1])
    assert read_index_bytes(str(p), Index(str(p)), same_as=[first]) == first[:-1]


def test_an_agreement_with_a_worker_s_reading_is_remembered_for_the_very_table_only(tmp_path: Path) -> None:
    """A worker's reading compares each shard's names sorted and joined; a header table found to
    hold exactly a shard's names is not sorted again when asked again, and another table (other
    names, or the same names in another table) is compared anew."""
    from safetensors.numpy import save_file
    import numpy as np

    from ckptctl.format.header import read_header
    from ckptctl.format.index import Index

    shard = "model-00001-of-00001.safetensors"
    save_file({"b": np.zeros(1, np.float32), "a": np.zeros(1, np.float32)}, str(tmp_path / "one.safetensors"))
    save_file({"a": np.zeros(1, np.float32), "c": np.zeros(1, np.float32)}, str(tmp_path / "two.safetensors"))
    same, wrong = (read_header(tmp_path / n).tensors for n in ("one.safetensors", "two.safetensors"))
    idx = Index.from_worker("index.json", b"{}", True,
                            {"findings": [], "metadata": {}, "shards": [shard], "joins": {shard: (2, "a\nb")}})
    assert idx.agrees({shard: same.keys()}, whole=True)
    assert idx._agreeing == {shard: same}
    assert idx.copy().agrees({shard: same}, whole=True)  # a copy shares what its original proved
    assert not idx.agrees({shard: wrong.keys()}, whole=True)
    assert not idx.agrees({shard: {"a", "c"}}, whole=True) and idx.agrees({shard: {"a", "b"}}, whole=True)
    assert idx._agreeing == {shard: same}
