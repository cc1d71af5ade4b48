"""The header's fast path (well-formed entries checked in one loop, Python's own int parser) gives
exactly what the strict path gives. A ``\\u`` escape anywhere in a header sends every entry down
the strict path (``_check_entry`` and the full serde walk), so the same entries parsed with and
without one escaped character in ``__metadata__`` must yield the same tensors and findings."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.format import dtypes as dt
from ckptctl.format.header import MAX_DIM_PRODUCT, parse_header_bytes

_dims = st.one_of(st.integers(0, 5), st.sampled_from([2**24, 2**25, -1, True, 1.0, "1", [1]]))
_entry = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from([d.name for d in dt.DTYPES]), st.sampled_from(["F33", 7, None])),
     "shape": st.one_of(st.lists(_dims, max_size=4), st.just("x"), st.just([MAX_DIM_PRODUCT, 2]))},
    optional={"extra": st.just(1)})


def _file(entries: list[dict], escaped: bool) -> bytes:
    obj: dict = {"__metadata__": {"format": "pt", "k": "ESC"}}
    offset = 0
    for i, e in enumerate(entries):
        e = dict(e)
        d = dt.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        size = 3
        if d and isinstance(e["shape"], list) and all(type(x) is int and x >= 0 for x in e["shape"]):
            n = 1
            for x in e["shape"]:
                n *= x
            size = n * d.bits // 8 + (i % 3 == 2)  # every third one a byte too long
        size = min(size, 1 << 12)
        e["data_offsets"] = [offset, offset + size] if i % 5 != 4 else [offset + size, offset]
        offset += size
        obj[f"t.{i}"] = e
    # the same length either way, so every offset in the file stays where it was
    text = json.dumps(obj).replace('"ESC"', '"\\u0041"' if escaped else '"A"     ')
    raw = text.encode() + b" " * (-len(text) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(min(offset, 1 << 16))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_entry, max_size=12))
def test_fast_path_equals_strict_path(entries: list[dict]) -> None:
    fast, strict = parse_header_bytes(_file(entries, False)), parse_header_bytes(_file(entries, True))
    assert fast.metadata == strict.metadata == {"format": "pt", "k": "A"}
    assert fast.tensors == strict.tensors
    assert list(fast.tensors) == list(strict.tensors)
    assert fast.findings == strict.findings


def test_negative_zero_and_huge_integers_take_the_strict_decoder() -> None:
    """``-0`` is serde's float (not a size) and a 5,000-digit integer is out of f64's range:
    both are still refused, while the fast decoder handles every other header."""
    for text in ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[-0,1]}}',
                 '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0, ' + "1" * 5000 + "]}}"):
        raw = text.encode() + b" " * (-len(text) % 8)
        hdr = parse_header_bytes(struct.pack("<Q", len(raw)) + raw + b"x")
        assert [f.code for f in hdr.findings] == (["header.bad_offsets"] if "-0" in text else ["header.bad_json"])


def test_a_negative_zero_is_found_in_the_value_that_holds_it_wherever_else_a_minus_zero_sits() -> None:
    """Each value the JSON parser reads is read again by the strict decoder when its own text holds
    a ``-0``: a ``-0`` in a name, in the metadata or in another entry decides nothing for the
    entry that has none, and the one entry that has one is refused."""
    text = ('{"__metadata__":{"format":"pt","note":"x-0"},"w-0":{"dtype":"U8", "shape":[1],"data_offsets":[0,1]},'
            '"z":{"dtype":"U8", "shape":[1],"data_offsets":[-0,1]},"y":{"dtype":"U8", "shape":[1],"data_offsets":[1,2]}}')
    raw = text.encode() + b" " * (-len(text) % 8)
    hdr = parse_header_bytes(struct.pack("<Q", len(raw)) + raw + b"xx")
    assert [(f.code, f.tensor) for f in hdr.findings] == [("header.bad_offsets", "z")]
    assert hdr.metadata == {"format": "pt", "note": "x-0"}


# The canonical form (``"name":{"dtype":..,"shape":[..],"data_offsets":[a,b]},`` with no space)
# is read a chunk of about a megabyte at a time by one regex; anything else entry by entry by
# json's scanner. The same header written with spaces (every entry then takes the scanner) must
# give the same tensors and findings, whatever oddity sits where: at the start, inside a chunk,
# last, or repeated across chunks.
_ODDITIES = {
    "none": ([], []),
    "zero_dim": ([('"l.777":{"dtype":"BF16","shape":[1]', '"l.777":{"dtype":"BF16","shape":[0]')],
                 ["header.size_mismatch"]),
    "repeat_across_chunks": ([('"l.30001":', '"l.5":')], ["header.duplicate_key"]),
    "repeat_last": ([('"l.9999":', '"l.0":')], ["header.duplicate_key"]),
    "metadata_inside": ([('"l.30001":', '"__metadata__":')], ["header.duplicate_key"]),
    "escape": ([('"l.30001":', '"l.\\u0033":')], ["header.duplicate_key"]),  # l.3 again
    "lone_surrogate": ([('"l.20001":', '"l.\\ud800":')], ["header.bad_json"]),
    "key_order": ([('"l.30001":{"dtype":"BF16","shape":[1]', '"l.30001":{"shape":[1],"dtype":"BF16"')], []),
    "size_mismatch": ([('"l.12":{"dtype":"BF16"', '"l.12":{"dtype":"F32"')], ["header.size_mismatch"]),
    "unknown_dtype": ([('"l.13":{"dtype":"BF16"', '"l.13":{"dtype":"BF17"')], ["header.unknown_dtype"]),
    "extra_field": ([('"l.31":{"dtype":"BF16"', '"l.31":{"x":1,"dtype":"BF16"')], ["header.extra_field"]),
    "leading_zero": ([('"l.2":{"dtype":"BF16","shape":[1]', '"l.2":{"dtype":"BF16","shape":[01]')],
                     ["header.bad_json"]),
    "huge_dim": ([('"l.3":{"dtype":"BF16","shape":[1]', '"l.3":{"dtype":"BF16","shape":[' + "9" * 30 + "]")],
                 ["header.offset_hole", "header.overflow"]),
    "negative_zero": ([('"l.4":{"dtype":"BF16","shape":[1]', '"l.4":{"dtype":"BF16","shape":[-0]')],
                      ["header.bad_shape", "header.offset_hole"]),
    "bad_json_late": ([('"l.39990":{', '"l.39990":{{')], ["header.bad_json"]),
    # an entry that does not begin where the one before it ends (the chunk's begins are then read
    # one by one): two swapped in the file, and one moved onto its neighbour's bytes
    # what _LOOSE's classes take and json refuses or reads otherwise, in an ASCII header without
    # an escape (where _LOOSE reads the chunks)
    "signed_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[+44456,44458]}')], ["header.bad_json"]),
    "spaced_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456, 44458]}')], []),
    "underscored_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44_456,44458]}')],
                           ["header.bad_json"]),
    "leading_zero_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[044456,44458]}')],
                            ["header.bad_json"]),
    "leading_zero_first_offset": ([('"l.0":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}',
                                   '"l.0":{"dtype":"BF16","shape":[1],"data_offsets":[00,2]}')], ["header.bad_json"]),
    "negative_zero_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[-0,44458]}')],
                             ["header.bad_offsets", "header.offset_hole"]),
    "fraction_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456,44458.0]}')],
                        ["header.bad_offsets", "header.offset_hole"]),
    "huge_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456,' + "9" * 25 + "]}")],
                    ["header.offset_overlap", "header.size_mismatch"]),
    "endless_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456,' + "9" * 5000 + "]}")],
                       ["header.bad_json"]),
    "spaced_name": ([('"l.30000":', '"l. 30000":')], []),
    "non_ascii_name": ([('"l.30000":', '"l.3\u00e9":')], []),  # the whole header then takes _CANONICAL
    "spaced_dim": ([('"l.30000":{"dtype":"BF16","shape":[1]', '"l.30000":{"dtype":"BF16","shape":[ 1]')], []),
    "signed_dim": ([('"l.30000":{"dtype":"BF16","shape":[1]', '"l.30000":{"dtype":"BF16","shape":[+1]')],
                   ["header.bad_json"]),
    "lowercase_dtype": ([('"l.30000":{"dtype":"BF16"', '"l.30000":{"dtype":"bf16"')], ["header.unknown_dtype"]),
    "quoted_dim": ([('"l.30000":{"dtype":"BF16","shape":[1]', '"l.30000":{"dtype":"BF16","shape":["1"]')],
                   ["header.bad_shape", "header.offset_hole"]),
    "swapped_offsets": ([('"l.30000":{"dtype":"BF16","shape":[1],"data_offsets":[44454,44456]}',
                          '"l.30000":{"dtype":"BF16","shape":[1],"data_offsets":[44456,44458]}'),
                         ('"l.30001":{"dtype":"BF16","shape":[1],"data_offsets":[44456,44458]}',
                          '"l.30001":{"dtype":"BF16","shape":[1],"data_offsets":[44454,44456]}')], []),
    "moved_onto_neighbour": ([('"l.1":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]}',
                               '"l.1":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}')],
                             ["header.offset_hole", "header.offset_overlap"]),
    "trailing_comma": ([('"l.9999":{"dtype":"BF16","shape":[1],"data_offsets":[79998,80000]}}',
                         '"l.9999":{"dtype":"BF16","shape":[1],"data_offsets":[79998,80000]},}')], ["header.bad_json"]),
}


def _spaced(text: str) -> str:
    return text.replace('":{"', '": {"').replace('":"', '": "').replace('":[', '": [').replace('},"', '}, "')


def _blob(text: str, data: int) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


@pytest.mark.parametrize("oddity", sorted(_ODDITIES))
def test_chunked_canonical_path_equals_the_scanner_path(oddity: str) -> None:
    from ckptctl.format.header import encode_header
    from ckptctl.format.tensor import TensorSpec

    head, infos = encode_header([TensorSpec(f"l.{i}", "BF16", (1,)) for i in range(40_000)], {"format": "pt"})
    text = head[8:].decode().rstrip(" ")
    assert len(text) > 2 << 20  # several chunks
    edits, codes = _ODDITIES[oddity]
    for old, new in edits:
        assert text.count(old) == 1
        text = text.replace(old, new)
    fast, scanned = parse_header_bytes(_blob(text, infos[-1].end)), parse_header_bytes(_blob(_spaced(text), infos[-1].end))
    assert [f.code for f in fast.findings] == [f.code for f in scanned.findings]
    assert [f.message for f in fast.findings] == [f.message for f in scanned.findings]
    assert list(fast.tensors.items()) == list(scanned.tensors.items())
    assert fast.metadata == scanned.metadata
    assert sorted({f.code for f in fast.findings}) == codes


def test_bulk_looks_at_most_two_chunks_ahead() -> None:
    """The chunked path never searches the whole header from each entry: a 40,000-entry header
    written with ", " separators (json.dumps' default) and two compact entries at its end took 27 s
    (a search to the end per entry) where the scanner alone takes 0.4 s."""
    from ckptctl.format.header import _CHUNK, _Columns

    def entry(i: int, spaced: bool) -> str:
        text = f'"l.{i}":{{"dtype":"BF16","shape":[1],"data_offsets":[{2 * i},{2 * i + 2}]}},'
        return _spaced(text) + " " if spaced else text

    n = 60_000
    text = "{" + entry(0, False) + " " + "".join(entry(i, True) for i in range(1, n)) + entry(n, False) + entry(n + 1, False)
    assert len(text) > 4 * _CHUNK
    cols = _Columns()
    assert cols.bulk(text, 1) == (1, 1 + 2 * _CHUNK)  # the entry path reads two chunks, then bulk tries again
    second = text.index('"l.1"')
    assert cols.bulk(text, second) == (second, second)  # not canonical: one failed match, no search
    last = f'"l.{n + 2}":{{"dtype":"BF16","shape":[1],"data_offsets":[{2 * n + 4},{2 * n + 6}]}}}}'
    parsed = parse_header_bytes(_blob(text + last, 2 * n + 6))
    assert [f.code for f in parsed.findings] == []
    assert len(parsed.tensors) == n + 3


@pytest.mark.parametrize("odd", [False, True], ids=["canonical", "one_by_one"])
@pytest.mark.parametrize("where", range(0, 60, 7))
def test_a_hole_or_an_overlap_at_any_entry_is_found_with_small_chunks(where: int, odd: bool, monkeypatch) -> None:
    """The chunked path proves a header contiguous from the chain of its rows (each entry begins
    where the one before ends, each chunk where the last one ended, each entry read one by one or
    by the JSON parser where the row before it ended): with chunks of a few entries, a hole or an
    overlap put before any entry (at a chunk's edge or inside one, and in a chunk read one entry at
    a time because the next entry is not canonical) is still found, as the scanner finds it."""
    from ckptctl.format import header as H

    monkeypatch.setattr(H, "_CHUNK", 300)
    for shift in (2, -2):
        entries, offset = [], 0
        for i in range(60):
            if i == where and i:
                offset += shift
            shape = "[ 1]" if odd and i == where + 1 else "[1]"  # valid JSON, not canonical
            entries.append(f'"l.{i}":{{"dtype":"BF16","shape":{shape},"data_offsets":[{offset},{offset + 2}]}}')
            offset += 2
        text = '{"__metadata__":{"format":"pt"},' + ",".join(entries) + "}"
        fast, scanned = parse_header_bytes(_blob(text, offset)), parse_header_bytes(_blob(_spaced(text), offset))
        assert [f.code for f in fast.findings] == [f.code for f in scanned.findings]
        assert list(fast.tensors.items()) == list(scanned.tensors.items())
        if where:
            assert {f.code for f in fast.findings} & {"header.offset_hole", "header.offset_overlap"}, (where, shift)
