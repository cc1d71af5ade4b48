"""The fast header decoder (msgspec into typed records, :mod:`ckptctl.format.header_fast`) gives
exactly what the strict reader gives, or falls back to it.

Every header here is parsed both ways and the results compared whole (findings with their
messages and details, metadata, the table row by row: :func:`same_header`). Each hostile text
(what msgspec lets through and the strict reader refuses) is also checked to fall back, and each
well-formed oddity to be read by the fast decoder itself, with the text cut into pieces of every
size: a piece of one entry, a few, or the whole header."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.format import dtypes as dt
from ckptctl.format import header as H
from ckptctl.format import header_fast
from ckptctl.format.encode import encode_header
from ckptctl.format.header import MAX_DIM_PRODUCT, Header, parse_header_bytes
from ckptctl.format.header_rules import check_entry, check_metadata, validate_layout
from ckptctl.format.tensor import TensorSpec
from tests.test_format_header import same_header

CHUNKS = [1, 64, 4096, header_fast.CHUNK]


def _blob(text: str | bytes, data: int = 0, *, pad: bytes = b" ") -> bytes:
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    raw += pad * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


def _via_fast(blob: bytes, chunk: int) -> Header | None:
    """What ``parse_header_bytes`` returns when the fast decoder reads the header in pieces of
    about ``chunk`` bytes (None: it falls back). For headers under the Hub's limit."""
    (n,) = struct.unpack("<Q", blob[:8])
    found = header_fast.decode(bytearray(blob[8:8 + n]), chunk=chunk)
    if found is None:
        return None
    hdr = Header(path="<bytes>", file_size=len(blob), header_len=n)
    check_metadata(hdr, found.metadata)
    validate_layout(hdr, found.table)
    return hdr


def _both_ways(blob: bytes, chunks: list[int] = CHUNKS) -> tuple[Header, bool]:
    """The reference result, and whether the fast decoder reads the header in pieces of the
    default size; with every piece size in ``chunks``, what the fast decoder reads is held to
    the reference (a cut inside a name makes a piece fail: the reference reads that header)."""
    strict = parse_header_bytes(blob, fast=False)
    same_header(parse_header_bytes(blob), strict)
    for chunk in chunks:
        fast = _via_fast(blob, chunk)
        if fast is not None:
            same_header(fast, strict)
    return strict, _via_fast(blob, header_fast.CHUNK) is not None


# ------------------------------------------------------------------------------------------
# Hostile and odd texts, one at a time

def _e(dtype: str = "U8", shape: str = "[1]", offsets: str = "[0,1]") -> str:
    return f'{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}'


E1, E2 = _e(), _e(offsets="[1,2]")

# (id, header text, data bytes, read by the fast decoder)
HOSTILE: list[tuple[str, str | bytes, int, bool]] = [
    # repeated keys: msgspec keeps the last copy silently
    ("dup_tensor", f'{{"a":{E1},"a":{E2}}}', 2, False),
    ("dup_tensor_same", f'{{"a":{E1},"a":{E1}}}', 1, False),
    ("dup_tensor_escaped", f'{{"a":{E1},"\\u0061":{E2}}}', 2, False),
    ("dup_tensor_apart", f'{{"a":{E1},"b":{E2},"a":{_e(offsets="[2,3]")}}}', 3, False),
    ("dup_dtype", '{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', 1, False),
    ("dup_dtype_differs", '{"a":{"dtype":"F32","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', 1, False),
    ("dup_shape", '{"a":{"dtype":"U8","shape":[2],"shape":[1],"data_offsets":[0,1]}}', 1, False),
    ("dup_offsets", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[5,6],"data_offsets":[0,1]}}', 1, False),
    ("dup_metadata", '{"__metadata__":{"format":"pt"},"__metadata__":{"format":"pt"}}', 0, False),
    ("dup_in_metadata", '{"__metadata__":{"format":"pt","format":"pt"}}', 0, False),
    ("dup_in_metadata_escaped", '{"__metadata__":{"format":"pt","\\u0066ormat":"pt"}}', 0, False),
    # lone surrogates (serde_json refuses them) and bytes that are not UTF-8
    ("surrogate_high", f'{{"\\ud800":{E1}}}', 1, False),
    ("surrogate_low", f'{{"\\udc00":{E1}}}', 1, False),
    ("surrogate_reversed", f'{{"\\udc00\\ud800":{E1}}}', 1, False),
    ("surrogate_then_char", f'{{"\\ud800\\u0041":{E1}}}', 1, False),
    ("surrogate_in_metadata", '{"__metadata__":{"format":"\\udfff"}}', 0, False),
    ("surrogate_pair", f'{{"\\ud83d\\ude00":{E1}}}', 1, True),
    ("not_utf8", b'{"\xff":' + E1.encode() + b"}", 1, False),
    ("utf8_surrogate_bytes", b'{"\xed\xa0\x80":' + E1.encode() + b"}", 1, False),
    ("utf8_overlong", b'{"\xc0\xae":' + E1.encode() + b"}", 1, False),
    ("utf8_too_high", b'{"\xf4\x90\x80\x80":' + E1.encode() + b"}", 1, False),
    ("utf8_truncated", b'{"\xe4\xb8":' + E1.encode() + b"}", 1, False),
    ("utf8_names", f'{{"权重.é":{E1},"😀":{E2}}}', 2, True),
    # numbers: -0 (serde: the float -0.0), fractions, leading zeros, signs, huge ones
    ("negative_zero_dim", f'{{"a":{_e(shape="[-0]", offsets="[0,0]")}}}', 0, False),
    ("negative_zero_dim_spaced", f'{{"a":{_e(shape="[ -0]", offsets="[0,0]")}}}', 0, False),
    ("negative_zero_offset", f'{{"a":{_e(offsets="[-0,1]")}}}', 1, False),
    ("negative_zero_end", f'{{"a":{_e(shape="[0]", offsets="[0,-0]")}}}', 0, False),
    ("negative_zero_dim_later", f'{{"a":{E1},"z":{_e(shape="[2,-0]", offsets="[1,1]")}}}', 1, False),
    ("negative_zero_begin_later", f'{{"a":{_e(shape="[0]", offsets="[0,0]")},"b":{_e(offsets="[-0,1]")}}}', 1, False),
    ("negative_dim", f'{{"a":{_e(shape="[-1]")}}}', 1, False),
    ("negative_dims_fill_a_byte", f'{{"a":{_e(shape="[-1,-1]")}}}', 1, False),
    ("negative_dims_later", f'{{"a":{E1},"n":{_e(shape="[-1,-1]", offsets="[1,2]")}}}', 2, False),
    ("negative_offset", f'{{"a":{_e(offsets="[-1,0]")}}}', 1, False),
    ("float_dim", f'{{"a":{_e(shape="[1.0]")}}}', 1, False),
    ("exponent_dim", f'{{"a":{_e(shape="[1e0]")}}}', 1, False),
    ("float_offset", f'{{"a":{_e(offsets="[0,1.0]")}}}', 1, False),
    ("bool_dim", f'{{"a":{_e(shape="[true]")}}}', 1, False),
    ("leading_zero_dim", f'{{"a":{_e(shape="[01]")}}}', 1, False),
    ("leading_zero_offset", f'{{"a":{_e(offsets="[00,1]")}}}', 1, False),
    ("plus_offset", f'{{"a":{_e(offsets="[+0,1]")}}}', 1, False),
    ("offset_2_64", f'{{"a":{_e(shape="[0]", offsets=f"[{2**64},{2**64}]")}}}', 1, False),
    ("offset_2_64_minus_1", f'{{"a":{_e(offsets=f"[{2**64 - 2},{2**64 - 1}]")}}}', 1, True),
    ("dim_2_64", f'{{"a":{_e(shape=f"[{2**64 + 1}]")}}}', 1, False),
    ("dim_2_64_times_0", f'{{"a":{_e(shape=f"[0,{2**64 + 1}]", offsets="[0,0]")}}}', 0, True),  # no finding: 0 elements
    ("dims_overflow_then_0", f'{{"a":{_e(shape=f"[{2**49},0]", offsets="[0,0]")}}}', 0, False),
    ("dims_overflow", f'{{"a":{_e("BOOL", f"[{2**25},{2**24}]", f"[0,{2**49}]")}}}', 0, False),
    ("dims_at_limit", f'{{"a":{_e("BOOL", f"[{2**24},{2**24}]", f"[0,{2**48}]")}}}', 0, True),
    ("digits_5000", f'{{"a":{_e(offsets="[0," + "1" * 5000 + "]")}}}', 1, False),
    ("nan", f'{{"a":{_e(offsets="[0,NaN]")}}}', 1, False),
    # whitespace, padding, byte-order mark
    ("leading_space", f' {{"a":{E1}}}', 1, False),
    ("bom", f'\ufeff{{"a":{E1}}}', 1, False),
    ("spaces_inside", '{ "a" : { "dtype" : "U8" , "shape" : [ 1 ] , "data_offsets" : [ 0 , 1 ] } \n}', 1, True),
    ("tab_padding", f'{{"a":{E1}}}\t', 1, False),
    ("newline_padding", f'{{"a":{E1}}}\n      ', 1, False),
    ("nul_padding", f'{{"a":{E1}}}\x00', 1, False),
    ("second_object", f'{{"a":{E1}}}{{}}', 1, False),
    ("brace_padding", f'{{"a":{E1}}}}}', 1, False),
    ("brace_padding_after_metadata", '{"__metadata__":{"format":"pt"}}}', 0, False),
    ("object_after_metadata", '{"__metadata__":{"format":"pt"}} {}', 0, False),
    ("not_an_object_first_byte", f'["a":{E1}}}', 1, False),
    ("trailing_comma", f'{{"a":{E1},}}', 1, False),
    ("trailing_comma_spaced", f'{{"a":{E1}, }}', 1, False),
    ("two_commas", f'{{"a":{E1},,"b":{E2}}}', 2, False),
    ("trailing_comma_after_metadata", '{"__metadata__":{"format":"pt"},}', 0, False),
    ("trailing_comma_after_metadata_spaced", '{"__metadata__":{"format":"pt"}, }', 0, False),
    ("empty", "{}", 0, True),
    ("empty_spaced", "{ \n }", 0, True),
    ("empty_metadata", '{"__metadata__":{}}', 0, True),
    ("unclosed", f'{{"a":{E1}', 1, False),
    # escapes: read alike unless they make a repeat or a surrogate (above)
    ("escaped_names", f'{{"a\\nb":{E1},"\\u00e9\\"\\\\\\/":{E2},"\\u0000":{_e(offsets="[2,3]")}}}', 3, True),
    ("escaped_dtype", '{"a":' + _e("\\u00558") + "}", 1, True),
    ("escaped_metadata", '{"__metadata__":{"format":"pt","n\\"":"a\\",\\"b\\":\\"c"}}', 0, True),
    # __metadata__: first, a map of strings, and never a tensor
    ("metadata_nested", '{"__metadata__":{"format":{"a":"b"}}}', 0, False),
    ("metadata_int", '{"__metadata__":{"format":"pt","n":1}}', 0, False),
    ("metadata_null", '{"__metadata__":null}', 0, False),
    ("metadata_list", '{"__metadata__":["pt"]}', 0, False),
    ("metadata_is_a_tensor", f'{{"__metadata__":{E1}}}', 1, False),
    ("metadata_then_tensor_named_so", f'{{"__metadata__":{{"format":"pt"}},"__metadata__":{E1}}}', 1, False),
    ("tensor_named_metadata_last", f'{{"a":{E1},"__metadata__":{E2}}}', 2, False),
    ("metadata_escaped_key", '{"\\u005f_metadata__":{"format":"pt"}}', 0, False),
    ("metadata_last", f'{{"a":{E1},"__metadata__":{{"format":"pt"}}}}', 1, False),
    ("metadata_spaced", f'{{ "__metadata__" : {{ "format" : "pt" , "a" : "b" }} , "a":{E1}}}', 1, True),
    ("metadata_spaced_last", '{"__metadata__" : {"format" : "pt"} }', 0, True),
    ("metadata_not_string", '{"__metadata__":{"format":"pt","x":["a"]}}', 0, False),
    ("metadata_tensor_keys", '{"__metadata__":{"dtype":"U8","shape":"1","data_offsets":"x"}}', 0, True),
    ("metadata_no_format", f'{{"__metadata__":{{"source":"x"}},"a":{E1}}}', 1, True),
    ("metadata_format_tf", f'{{"__metadata__":{{"format":"tf"}},"a":{E1}}}', 1, True),
    # entries: exactly the three keys, a known dtype, the size they imply
    ("unknown_key", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}', 1, False),
    ("unknown_key_deep", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + "[" * 130 + "]" * 130 + "}}",
     1, False),
    ("missing_key", '{"a":{"dtype":"U8","shape":[1]}}', 1, False),
    ("not_an_object", '{"a":[1]}', 0, False),
    ("unknown_dtype", f'{{"a":{_e("F128")}}}', 1, False),
    ("lowercase_dtype", f'{{"a":{_e("u8")}}}', 1, False),
    ("size_mismatch", f'{{"a":{_e("F32")}}}', 1, False),
    ("partial_byte", f'{{"a":{_e("F4", "[3]", "[0,2]")}}}', 2, False),
    ("partial_byte_floor", f'{{"a":{_e("F4", "[3]", "[0,1]")}}}', 1, False),
    ("partial_byte_f6", f'{{"a":{_e("F6_E2M3", "[3]", "[0,2]")}}}', 2, False),
    ("whole_bytes_f6", f'{{"a":{_e("F6_E2M3", "[4]", "[0,3]")}}}', 3, True),
    ("offsets_reversed", f'{{"a":{_e(shape="[0]", offsets="[1,0]")}}}', 1, False),
    ("three_offsets", f'{{"a":{_e(offsets="[0,1,1]")}}}', 1, False),
    ("key_order", '{"a":{"data_offsets":[0,1],"shape":[1],"dtype":"U8"}}', 1, True),
    ("empty_name", f'{{"":{E1}}}', 1, True),
    ("zero_size", f'{{"a":{_e(shape="[2,0]", offsets="[0,0]")},"b":{E1}}}', 1, True),
    ("zero_size_between", f'{{"a":{E1},"z":{_e(shape="[0]", offsets="[1,1]")},"b":{E2}}}', 2, True),
    ("scalar", f'{{"a":{_e("F32", "[]", "[0,4]")}}}', 4, True),
    # what only the shared rules find: the fast decoder reads these
    ("out_of_order", f'{{"b":{E2},"a":{E1}}}', 2, True),
    ("hole", f'{{"a":{_e(offsets="[1,2]")}}}', 2, True),
    ("overlap", f'{{"a":{_e(shape="[2]", offsets="[0,2]")},"b":{E2}}}', 2, True),
    ("same_bytes", f'{{"a":{E1},"b":{E1}}}', 1, True),
    ("truncated", f'{{"a":{_e(shape="[2]", offsets="[0,2]")}}}', 1, True),
    ("trailing_bytes", f'{{"a":{E1}}}', 3, True),
    ("unaligned_tensor", f'{{"a":{_e(shape="[3]", offsets="[0,3]")},"b":{_e("F32", offsets="[3,7]")}}}', 7, True),
    # names the proofs cannot tell from structure: read by the reference reader
    ("colon_in_name", f'{{"a:b":{E1}}}', 1, False),
    ("brace_comma_in_name", f'{{"a}},":{E1},"b":{E2}}}', 2, True),  # (not with 1-byte pieces)
    ("sign_after_comma_in_name", f'{{"a,-1":{E1}}}', 1, False),
    ("dash_in_name", f'{{"a-0":{E1},"b-1":{E2}}}', 2, True),
]


@pytest.mark.parametrize("name,text,data,fast", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_and_odd_texts(name: str, text: str | bytes, data: int, fast: bool) -> None:
    _, taken = _both_ways(_blob(text, data))
    assert taken is fast


@pytest.mark.parametrize("name,text,data,fast", [h for h in HOSTILE if not h[3]], ids=[h[0] for h in HOSTILE if not h[3]])
def test_a_hostile_text_has_a_finding_or_an_entry_the_fast_decoder_cannot_prove(name, text, data, fast) -> None:
    """A fallback is never for nothing: the header has a finding, a name the proofs cannot tell
    from structure (a colon, a sign after a comma), or a ``__metadata__`` that is not first, or
    null, or written with an escape."""
    hdr = parse_header_bytes(_blob(text, data), fast=False)
    assert hdr.findings or name in {"colon_in_name", "sign_after_comma_in_name", "metadata_last", "metadata_null",
                                    "metadata_escaped_key"}


def test_msgspec_refuses_what_the_fast_decoder_leaves_to_it() -> None:
    """The proofs in :mod:`ckptctl.format.header_fast` rely on msgspec refusing these in a typed
    decode (a release that took them would make the fast decoder read them wrongly)."""
    import msgspec

    decoder = msgspec.json.Decoder(dict[str, str])
    for text in (b'{"\\ud800":"x"}', b'{"a":"\\udc00"}', b'{"\xff":"x"}', b'{"\xed\xa0\x80":"x"}',
                 b'{"\xc0\xae":"x"}', b'{"a":1}', b'{"a":"x",}', b'{"a":"x"}\x00', b'{"a":"\x01"}', b'{"a":"\\x"}'):
        with pytest.raises(msgspec.DecodeError):
            decoder.decode(text)
    ints = msgspec.json.Decoder(tuple[int, ...])
    for text in (b"[1.0]", b"[1e0]", b"[true]", b"[01]", b"[+1]", b"[NaN]", b"[" + b"1" * 5000 + b"]"):
        with pytest.raises(msgspec.DecodeError):
            ints.decode(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=4), st.integers(0, 3))
def test_any_bytes_in_a_name_are_read_alike(junk: bytes, where: int) -> None:
    """UTF-8 (and JSON string) validity is msgspec's: whatever bytes sit in a name, the fast
    reading equals the reference."""
    names = [b"a", b"b", b"c", b"d"]
    names[where] += junk
    text = b"{" + b",".join(b'"' + n + b'":' + _e(offsets=f"[{i},{i + 1}]").encode() for i, n in enumerate(names)) + b"}"
    _both_ways(_blob(text, 4), [1, header_fast.CHUNK])


# ------------------------------------------------------------------------------------------
# Random entries

_dims = st.one_of(st.integers(0, 5), st.sampled_from([2**24, 2**25, -1, True, 1.0, "1", [1]]))
_entry = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from([d.name for d in dt.DTYPES]), st.sampled_from(["F33", 7, None])),
     "shape": st.one_of(st.lists(_dims, max_size=4), st.just("x"), st.just([MAX_DIM_PRODUCT, 2]))},
    optional={"extra": st.just(1)})


def _file(entries: list[dict], escaped: bool, separators: tuple[str, str]) -> bytes:
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
    text = json.dumps(obj, separators=separators).replace('"ESC"', '"\\u0041"' if escaped else '"A"     ')
    raw = text.encode() + b" " * (-len(text) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(min(offset, 1 << 16))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_entry, max_size=12), st.sampled_from([(",", ":"), (", ", ": ")]))
def test_random_entries_are_read_alike(entries: list[dict], separators: tuple[str, str]) -> None:
    """Entries of every kind, well-formed or not, compact or spaced, with and without an escape
    in the metadata: the fast reading equals the reference, piece by piece too."""
    plain, _ = _both_ways(_file(entries, False, separators), [1, 64, header_fast.CHUNK])
    escaped, _ = _both_ways(_file(entries, True, separators), [1, 64, header_fast.CHUNK])
    assert plain.metadata == escaped.metadata == {"format": "pt", "k": "A"}
    assert list(plain.tensors.items()) == list(escaped.tensors.items())
    assert plain.findings == escaped.findings


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"dtype": st.sampled_from([d.name for d in dt.DTYPES] + ["F33"]),
                              "shape": st.lists(st.one_of(st.integers(0, 2**50), st.just(-1), st.just(True)),
                                                max_size=3),
                              "data_offsets": st.lists(st.integers(-1, 2**20), min_size=2, max_size=2)}))
def test_the_strict_readers_row_shortcut_is_check_entry(entry: dict) -> None:
    """The strict reader keeps an entry :func:`check_entry` accepts without a finding as a row
    (``_plain``), with no dict kept: the same tensor, and only for such entries."""
    hdr = Header(path="x", file_size=0)
    info = check_entry(hdr, "t", entry)
    plain = H._plain(entry)
    if plain is None:
        assert info is None or hdr.findings
    else:
        assert not hdr.findings and info is not None
        assert (info.dtype, info.begin, info.end, info.shape) == plain


# ------------------------------------------------------------------------------------------
# Large headers: oddities anywhere in 40,000 entries (several pieces)

# (edits, the finding codes, read by the fast decoder)
_ODDITIES: dict[str, tuple[list[tuple[str, str]], list[str], bool]] = {
    "none": ([], [], True),
    "zero_dim": ([('"l.777":{"dtype":"BF16","shape":[1]', '"l.777":{"dtype":"BF16","shape":[0]')],
                 ["header.size_mismatch"], False),
    "zero_size": ([('"l.0":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]',
                    '"l.0":{"dtype":"BF16","shape":[0],"data_offsets":[0,0]')],
                  ["header.offset_hole"], True),
    "repeat_across_pieces": ([('"l.30001":', '"l.5":')], ["header.duplicate_key"], False),
    "repeat_next": ([('"l.30001":', '"l.30000":')], ["header.duplicate_key"], False),
    "repeat_last": ([('"l.9999":', '"l.0":')], ["header.duplicate_key"], False),
    "metadata_inside": ([('"l.30001":', '"__metadata__":')], ["header.duplicate_key"], False),
    "escape": ([('"l.30001":', '"l.\\u0033":')], ["header.duplicate_key"], False),  # l.3 again
    "lone_surrogate": ([('"l.20001":', '"l.\\ud800":')], ["header.bad_json"], False),
    "key_order": ([('"l.30001":{"dtype":"BF16","shape":[1]', '"l.30001":{"shape":[1],"dtype":"BF16"')], [], True),
    "size_mismatch": ([('"l.12":{"dtype":"BF16"', '"l.12":{"dtype":"F32"')], ["header.size_mismatch"], False),
    "unknown_dtype": ([('"l.13":{"dtype":"BF16"', '"l.13":{"dtype":"BF17"')], ["header.unknown_dtype"], False),
    "extra_field": ([('"l.31":{"dtype":"BF16"', '"l.31":{"x":1,"dtype":"BF16"')], ["header.extra_field"], False),
    "repeated_field": ([('"l.31":{"dtype":"BF16"', '"l.31":{"dtype":"BF16","dtype":"BF16"')],
                       ["header.duplicate_key"], False),
    "leading_zero": ([('"l.2":{"dtype":"BF16","shape":[1]', '"l.2":{"dtype":"BF16","shape":[01]')],
                     ["header.bad_json"], False),
    "huge_dim": ([('"l.3":{"dtype":"BF16","shape":[1]', '"l.3":{"dtype":"BF16","shape":[' + "9" * 30 + "]")],
                 ["header.offset_hole", "header.overflow"], False),
    "negative_zero": ([('"l.4":{"dtype":"BF16","shape":[1]', '"l.4":{"dtype":"BF16","shape":[-0]')],
                      ["header.bad_shape", "header.offset_hole"], False),
    "bad_json_late": ([('"l.39990":{', '"l.39990":{{')], ["header.bad_json"], False),
    "signed_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[+44456,44458]}')], ["header.bad_json"], False),
    "spaced_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456, 44458]}')], [], True),
    "underscored_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44_456,44458]}')],
                           ["header.bad_json"], False),
    "leading_zero_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[044456,44458]}')],
                            ["header.bad_json"], False),
    "leading_zero_first_offset": ([('"l.0":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}',
                                   '"l.0":{"dtype":"BF16","shape":[1],"data_offsets":[00,2]}')], ["header.bad_json"],
                                  False),
    "negative_zero_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[-0,44458]}')],
                             ["header.bad_offsets", "header.offset_hole"], False),
    "fraction_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456,44458.0]}')],
                        ["header.bad_offsets", "header.offset_hole"], False),
    "huge_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456,' + "9" * 25 + "]}")],
                    ["header.offset_overlap", "header.size_mismatch"], False),
    "endless_offset": ([('"data_offsets":[44456,44458]}', '"data_offsets":[44456,' + "9" * 5000 + "]}")],
                       ["header.bad_json"], False),
    "spaced_name": ([('"l.30000":', '"l. 30000":')], [], True),
    "non_ascii_name": ([('"l.30000":', '"l.3\u00e9":')], [], True),
    "spaced_dim": ([('"l.30000":{"dtype":"BF16","shape":[1]', '"l.30000":{"dtype":"BF16","shape":[ 1]')], [], True),
    "signed_dim": ([('"l.30000":{"dtype":"BF16","shape":[1]', '"l.30000":{"dtype":"BF16","shape":[+1]')],
                   ["header.bad_json"], False),
    "lowercase_dtype": ([('"l.30000":{"dtype":"BF16"', '"l.30000":{"dtype":"bf16"')], ["header.unknown_dtype"],
                        False),
    "quoted_dim": ([('"l.30000":{"dtype":"BF16","shape":[1]', '"l.30000":{"dtype":"BF16","shape":["1"]')],
                   ["header.bad_shape", "header.offset_hole"], False),
    "swapped_offsets": ([('"l.30000":{"dtype":"BF16","shape":[1],"data_offsets":[44454,44456]}',
                          '"l.30000":{"dtype":"BF16","shape":[1],"data_offsets":[44456,44458]}'),
                         ('"l.30001":{"dtype":"BF16","shape":[1],"data_offsets":[44456,44458]}',
                          '"l.30001":{"dtype":"BF16","shape":[1],"data_offsets":[44454,44456]}')], [], True),
    "moved_onto_neighbour": ([('"l.1":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]}',
                               '"l.1":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}')],
                             ["header.offset_hole", "header.offset_overlap"], True),
    "trailing_comma": ([('"l.9999":{"dtype":"BF16","shape":[1],"data_offsets":[79998,80000]}}',
                         '"l.9999":{"dtype":"BF16","shape":[1],"data_offsets":[79998,80000]},}')], ["header.bad_json"],
                       False),
}


def _spaced(text: str) -> str:
    return text.replace('":{"', '": {"').replace('":"', '": "').replace('":[', '": [').replace('},"', '}, "')


@pytest.fixture(scope="module")
def large() -> tuple[str, int]:
    head, infos = encode_header([TensorSpec(f"l.{i}", "BF16", (1,)) for i in range(40_000)], {"format": "pt"})
    text = head[8:].decode().rstrip(" ")
    assert len(text) > 8 * header_fast.CHUNK  # several pieces
    return text, infos[-1].end


@pytest.mark.parametrize("oddity", sorted(_ODDITIES))
def test_an_oddity_anywhere_in_a_large_header(oddity: str, large: tuple[str, int]) -> None:
    """The same header compact (safetensors' form) and spaced (json.dumps' default), with one
    oddity: at the start, inside a piece, last, or repeated across pieces."""
    text, data = large
    edits, codes, fast = _ODDITIES[oddity]
    for old, new in edits:
        assert text.count(old) == 1
        text = text.replace(old, new)
    compact, taken = _both_ways(_blob(text, data), [4096, header_fast.CHUNK])
    spaced, spaced_taken = _both_ways(_blob(_spaced(text), data), [header_fast.CHUNK])
    assert taken is spaced_taken is fast
    assert [f.code for f in compact.findings] == [f.code for f in spaced.findings]
    assert [f.message for f in compact.findings] == [f.message for f in spaced.findings]
    assert list(compact.tensors.items()) == list(spaced.tensors.items())
    assert compact.metadata == spaced.metadata
    assert sorted({f.code for f in compact.findings}) == codes


@pytest.mark.parametrize("where", range(0, 60, 7))
def test_a_hole_or_an_overlap_at_any_entry_is_found_with_small_pieces(where: int) -> None:
    """The fast decoder proves a header contiguous from its rows' columns whatever piece each row
    came from: a hole or an overlap before any entry (at a piece's edge or inside one) is found,
    as the reference finds it."""
    for shift in (2, -2):
        entries, offset = [], 0
        for i in range(60):
            if i == where and i:
                offset += shift
            entries.append(f'"l.{i}":{{"dtype":"BF16","shape":[1],"data_offsets":[{offset},{offset + 2}]}}')
            offset += 2
        text = '{"__metadata__":{"format":"pt"},' + ",".join(entries) + "}"
        hdr, taken = _both_ways(_blob(text, offset), [1, 100, 300, header_fast.CHUNK])
        assert taken
        if where:
            assert {f.code for f in hdr.findings} & {"header.offset_hole", "header.offset_overlap"}, (where, shift)


def test_negative_zero_and_huge_integers_take_the_reference() -> None:
    """``-0`` is serde's float (not a size) and a 5,000-digit integer is out of f64's range:
    both are refused, the same way with the fast decoder on."""
    for text in ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[-0,1]}}',
                 '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0, ' + "1" * 5000 + "]}}"):
        hdr, taken = _both_ways(_blob(text, 1))
        assert not taken
        assert [f.code for f in hdr.findings] == (["header.bad_offsets"] if "-0" in text else ["header.bad_json"])


def test_a_negative_zero_is_found_in_the_value_that_holds_it_wherever_else_a_minus_zero_sits() -> None:
    """The reference reads a value again with the strict number rules when its own text holds a
    ``-0``: a ``-0`` in a name, in the metadata or in another entry decides nothing for the entry
    that has none, and the one entry that has one is refused."""
    text = ('{"__metadata__":{"format":"pt","note":"x-0"},"w-0":{"dtype":"U8", "shape":[1],"data_offsets":[0,1]},'
            '"z":{"dtype":"U8", "shape":[1],"data_offsets":[-0,1]},"y":{"dtype":"U8", "shape":[1],"data_offsets":[1,2]}}')
    hdr, _ = _both_ways(_blob(text, 2))
    assert [(f.code, f.tensor) for f in hdr.findings] == [("header.bad_offsets", "z")]
    assert hdr.metadata == {"format": "pt", "note": "x-0"}
