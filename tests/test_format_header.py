"""The safetensors header layer against the real safetensors library.

Golden: ``encode_header`` produces the very bytes ``safetensors.torch.save``/``save_file`` write,
and the same data layout. Malformed headers (built byte by byte) each produce their precise
finding code. Fuzzing: random bytes and mutations of valid files never raise, never allocate
from a length field, and every file ``safe_open`` rejects gets at least one error finding.

Every header here is read both ways (``fast`` on and off), and :func:`parse` holds the fast
reading to the reference one: the same findings (message, hint and details too), metadata and
table, row by row.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save, save_file

from ckptctl.errors import InputError, OperationalError
from ckptctl.findings import ERROR, WARNING
from ckptctl.format import dtypes as dt
from ckptctl.format import header_fast
from ckptctl.format.header import (
    MAX_HEADER_SIZE,
    Header,
    encode_header,
    header_size_of,
    load_header,
    parse_header_bytes,
    read_header,
)
from ckptctl.format.tensor import TensorSpec

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FAST = pytest.mark.parametrize("fast", [True, False], ids=["fast", "strict"])


def same_header(a: Header, b: Header) -> None:
    """The same result: every finding (code, severity, message, hint, tensor, details), the
    metadata, and the table row by row, with its kinds and their codes."""
    assert a.findings == b.findings
    assert (a.path, a.file_size, a.header_len, a.metadata) == (b.path, b.file_size, b.header_len, b.metadata)
    ta, tb = a.tensors, b.tensors  # row by row (name, dtype, shape, begin, end), compared by column
    assert ta._names == tb._names and list(ta._begin) == list(tb._begin) and list(ta._end) == list(tb._end)
    assert list(map(ta._kinds.__getitem__, ta._kind)) == list(map(tb._kinds.__getitem__, tb._kind))
    assert a.tensors.kinds == b.tensors.kinds
    assert list(a.tensors.kind_codes) == list(b.tensors.kind_codes)
    assert a.tensors._contiguous == b.tensors._contiguous


def parse(blob: bytes, fast: bool = True, path: str = "<bytes>") -> Header:
    """``parse_header_bytes``; with ``fast``, held to the reference reader's result."""
    hdr = parse_header_bytes(blob, path=path, fast=fast)
    if fast:
        same_header(hdr, parse_header_bytes(blob, path=path, fast=False))
    return hdr


def fast_taken(blob: bytes) -> bool:
    """The fast decoder reads this file's header itself (no fallback)."""
    (n,) = struct.unpack("<Q", blob[:8])
    return header_fast.decode(bytearray(blob[8:8 + n])) is not None

# Every safetensors dtype torch can hold (F6_* have no torch dtype).
TORCH_DTYPES = [d for d in dt.DTYPES if d.torch_name and hasattr(torch, d.torch_name)]


def make_tensor(d: dt.DType, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A tensor of safetensors dtype ``d`` whose *header* shape is ``shape``, with random bits."""
    td = getattr(torch, d.torch_name)
    if d.name == "F4":  # float4_e2m1fn_x2 packs two values per element; the header counts values
        assert shape and shape[-1] % 2 == 0
        shape = shape[:-1] + (shape[-1] // 2,)
    numel = 1
    for s in shape:
        numel *= s
    if d.name == "BOOL":
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    raw = torch.randint(0, 256, (numel * max(1, d.bits // 8),), dtype=torch.uint8, generator=gen)
    return raw.view(td).reshape(shape)


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    d = dt.from_torch(t.dtype)
    shape = tuple(t.shape)
    if d.name == "F4":
        shape = shape[:-1] + (shape[-1] * 2,)
    return TensorSpec(name, d.name, shape)


def st_header(blob: bytes) -> tuple[bytes, list[tuple[str, dict]]]:
    """The header bytes safetensors wrote and its top-level entries in file order."""
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[:8 + n], list(json.loads(blob[8:8 + n]).items())


def st_metadata_order(blob: bytes) -> dict[str, str] | None:
    """safetensors writes ``__metadata__`` from a Rust HashMap: its key order is random per
    process. The encoder keeps the caller's order, so goldens pass the order safetensors used."""
    _, pairs = st_header(blob)
    for k, v in pairs:
        if k == "__metadata__":
            return dict(v)
    return None


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_golden(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    blob = save(tensors, metadata=metadata)
    header, pairs = st_header(blob)
    specs = [spec_of(k, v) for k, v in tensors.items()]
    ordered_meta = st_metadata_order(blob) if metadata is not None else None
    if metadata is not None:
        assert ordered_meta == metadata
    mine, infos = encode_header(specs, ordered_meta)
    assert mine == header
    assert header_size_of(specs, ordered_meta) == len(header)
    # Identical layout: same tensor order and offsets, and the data section is exactly the
    # tensors' bytes at those offsets.
    st_offsets = [(k, tuple(v["data_offsets"])) for k, v in pairs if k != "__metadata__"]
    assert [(i.name, (i.begin, i.end)) for i in infos] == st_offsets
    data = blob[len(header):]
    assert len(data) == sum(i.nbytes for i in infos)
    for i in infos:
        assert data[i.begin:i.end] == tensor_bytes(tensors[i.name]), i.name
    # And the validator has nothing to say about an official file (either way: parse holds the
    # fast reading to the reference).
    hdr = parse(blob)
    if metadata is None or metadata.get("format") in ("pt", "mlx"):
        expected = []
    else:
        expected = ["header.format_missing" if "format" not in metadata else "header.format_unknown"]
    assert [f.code for f in hdr.findings] == expected
    assert list(hdr.tensors) == [i.name for i in infos]
    return blob


# ------------------------------------------------------------------------------------------
# Golden encoding


@pytest.mark.parametrize("d", TORCH_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(2, 4), (6,), (1, 2, 2)])
def test_golden_each_dtype(d: dt.DType, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    assert_golden({"w": make_tensor(d, shape, gen)})


def test_torch_covers_every_dtype_but_f6() -> None:
    assert {d.name for d in dt.DTYPES} - {d.name for d in TORCH_DTYPES} == {"F6_E2M3", "F6_E3M2"}


def test_golden_all_dtypes_in_one_file() -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = {}
    for i, d in enumerate(reversed(TORCH_DTYPES)):
        tensors[f"layer.{i}.{d.name.lower()}"] = make_tensor(d, (3, 2 + 2 * (i % 3)), gen)
        tensors[f"z{i}"] = make_tensor(d, (2,), gen)
    blob = assert_golden(tensors, {"format": "pt"})
    assert fast_taken(blob)
    # The writer orders by dtype (descending enum order), then by name.
    hdr = parse(blob)
    ranks = [dt.RANK[t.dtype] for t in hdr.tensors.values()]
    assert ranks == sorted(ranks, reverse=True)


def test_golden_scalars_and_zero_size() -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "scalar_f32": torch.tensor(1.5),
        "scalar_i64": torch.tensor(-7, dtype=torch.int64),
        "scalar_bool": torch.tensor(True),
        "scalar_bf16": torch.tensor(2.0, dtype=torch.bfloat16),
        "empty_2x0": torch.empty(2, 0),
        "empty_0": torch.empty(0, dtype=torch.float16),
        "empty_0x3x0": torch.empty(0, 3, 0, dtype=torch.int8),
        "vec": make_tensor(dt.BY_NAME["F32"], (5,), gen),
    }
    blob = assert_golden(tensors)
    assert fast_taken(blob)  # zero-size tensors too
    hdr = parse(blob)
    assert hdr.tensors["scalar_f32"].shape == ()
    assert hdr.tensors["scalar_f32"].numel == 1
    assert hdr.tensors["empty_2x0"].nbytes == 0


def test_golden_no_tensors() -> None:
    assert_golden({})
    assert_golden({}, {"format": "pt"})


def test_safetensors_empty_file_with_empty_metadata_is_invalid() -> None:
    """safetensors 0.8.0 writes ``{},"__metadata__":{}}`` for ``save({}, metadata={})``, a file
    it cannot read back. ckptctl flags that file and encodes the valid header instead."""
    blob = save({}, metadata={})
    assert [f.code for f in parse(blob).findings] == ["header.bad_padding"]
    mine, infos = encode_header([], {})
    assert mine[8:].rstrip(b" ") == b'{"__metadata__":{}}' and infos == []
    assert parse(mine).findings[0].code == "header.format_missing"


UNICODE_NAMES = [
    "model.embed_tokens.weight", "ünïcödé.权重", "emoji😀.bias", 'quote"and\\backslash',
    "new\nline\ttab\rcr", "ctl\x00\x01\x1f\x7f", "line\u2028sep\u2029", "[red]markup[/red]", "a b c",
    "Z", "a", "a10", "a9", "_", "é", "e\u0301", "\ufeffbom",
]


def test_golden_unicode_and_escaped_names() -> None:
    gen = torch.Generator().manual_seed(4)
    tensors = {n: make_tensor(dt.BY_NAME["F16"], (2,), gen) for n in UNICODE_NAMES}
    assert fast_taken(assert_golden(tensors))  # escapes, quotes, a BOM inside a name: read by msgspec
    assert fast_taken(assert_golden(tensors, {"format": "pt"}))


@pytest.mark.parametrize("metadata", [
    {"format": "pt"},
    {},
    {"format": "mlx"},
    {"note": 'ünï "q" \\ \n\x01 😀'},
    {"format": "pt", "total_size": "123", "aliases": json.dumps({"lm_head.weight": "embed.weight"})},
    {"__metadata__": "x", "format": "pt"},
])
def test_golden_metadata(metadata: dict[str, str]) -> None:
    gen = torch.Generator().manual_seed(5)
    blob = assert_golden({"b": make_tensor(dt.BY_NAME["BF16"], (4,), gen),
                          "a": make_tensor(dt.BY_NAME["U8"], (3,), gen)}, metadata)
    assert fast_taken(blob)


@FAST
def test_golden_save_file_on_disk(tmp_path: Path, fast: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    tensors = {"emb": make_tensor(dt.BY_NAME["F32"], (4, 3), gen),
               "mask": make_tensor(dt.BY_NAME["BOOL"], (5,), gen),
               "q": make_tensor(dt.BY_NAME["F8_E4M3"], (7,), gen)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    blob = path.read_bytes()
    mine, infos = encode_header([spec_of(k, v) for k, v in tensors.items()], {"format": "pt"})
    assert blob[:len(mine)] == mine
    hdr = read_header(path, fast=fast)
    assert hdr.findings == [] and hdr.ok
    assert hdr.data_start == len(mine)
    assert [(t.name, t.begin, t.end) for t in hdr.tensors.values()] == [(i.name, i.begin, i.end) for i in infos]
    assert hdr.file_size == len(mine) + hdr.data_bytes
    assert hdr.metadata == {"format": "pt"}


_names = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=10).filter(
    lambda s: s != "__metadata__")
_meta = st.none() | st.dictionaries(st.text(st.characters(exclude_categories=("Cs",)), max_size=6),
                                    st.text(st.characters(exclude_categories=("Cs",)), max_size=6), max_size=4)


@FUZZ
@given(st.dictionaries(_names, st.tuples(st.sampled_from(TORCH_DTYPES),
                                         st.lists(st.integers(0, 3), max_size=3)), max_size=8),
       _meta, st.integers(0, 2**31))
def test_golden_random_sets(spec: dict, metadata: dict | None, seed: int) -> None:
    assume(spec or metadata != {})  # see test_safetensors_empty_file_with_empty_metadata_is_invalid
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (d, shape) in spec.items():
        shape = tuple(shape)
        if d.name == "F4":
            shape = shape[:-1] + (shape[-1] * 2,) if shape else (2,)
        tensors[name] = make_tensor(d, shape, gen)
    assert_golden(tensors, metadata)


def test_encode_rejects_what_safetensors_cannot_read() -> None:
    with pytest.raises(ValueError):
        encode_header([TensorSpec("__metadata__", "F32", (1,))])
    with pytest.raises(ValueError):
        encode_header([TensorSpec("a", "F32", (1,)), TensorSpec("a", "F16", (1,))])
    with pytest.raises(ValueError):
        encode_header([TensorSpec("a", "F32", (1,))], {"format": 1})  # type: ignore[dict-item]


def test_encode_sub_byte_f6_layout() -> None:
    # F6 has no torch dtype; the encoder still lays it out (4 values = 3 bytes) after wider types.
    blob, infos = encode_header([TensorSpec("s", "F6_E2M3", (4,)), TensorSpec("w", "F32", (2,))])
    assert [(i.name, i.begin, i.end) for i in infos] == [("w", 0, 8), ("s", 8, 11)]
    assert parse(blob + bytes(11)).findings == []


# ------------------------------------------------------------------------------------------
# Malformed headers, built by hand


def mk(header: str | bytes | dict, data: bytes = b"", *, pad: bool = True) -> bytes:
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8")
    if pad:
        header += b" " * ((-len(header)) % 8)
    return struct.pack("<Q", len(header)) + header + data


def E(dtype: str = "U8", shape: object = (1,), offsets: object = (0, 1), **extra: object) -> dict:
    entry = {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
             "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}
    entry.update(extra)
    return entry


LFS = (b"version https://git-lfs.github.com/spec/v1\n"
       b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 4939342624\n")

# (id, file bytes, the exact set of finding codes, severity of those findings)
MALFORMED: list[tuple[str, bytes, set[str], str]] = [
    ("empty", b"", {"header.too_small"}, ERROR),
    ("seven_bytes", b"\x08\x00\x00\x00\x00\x00\x00", {"header.too_small"}, ERROR),
    ("lfs_pointer", LFS, {"header.lfs_pointer"}, ERROR),
    ("html_page", b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body></body></html>\n",
     {"header.html_page"}, ERROR),
    ("html_upper", b"  <HTML><BODY>404</BODY></HTML>", {"header.html_page"}, ERROR),
    ("xml_error", b"<?xml version='1.0'?><Error><Code>AccessDenied</Code></Error>", {"header.html_page"}, ERROR),
    ("too_large", struct.pack("<Q", MAX_HEADER_SIZE + 1) + b"{}      ", {"header.too_large"}, ERROR),
    ("too_large_2_63", struct.pack("<Q", 2**63) + b"{}", {"header.too_large"}, ERROR),
    ("too_large_max_u64", b"\xff" * 8 + b"{}", {"header.too_large"}, ERROR),
    ("length_exceeds_file", struct.pack("<Q", 64) + b"{}      ", {"header.length_exceeds_file"}, ERROR),
    ("length_at_limit", struct.pack("<Q", MAX_HEADER_SIZE) + b"{}", {"header.length_exceeds_file"}, ERROR),
    ("not_utf8", mk(b'{"\xff\xfe":1}'), {"header.not_utf8"}, ERROR),
    ("utf8_surrogate_bytes", mk(b'{"\xed\xa0\x80":1}'), {"header.not_utf8"}, ERROR),
    ("not_object_list", mk("[]"), {"header.not_object"}, ERROR),
    ("not_object_string", mk('"abc"'), {"header.not_object"}, ERROR),
    ("not_object_text", mk("hello"), {"header.not_object"}, ERROR),
    ("not_object_zero_length", struct.pack("<Q", 0), {"header.not_object"}, ERROR),
    ("leading_whitespace", mk("  {}"), {"header.leading_whitespace"}, WARNING),
    ("duplicate_key", mk('{"a":' + json.dumps(E()) + ',"a":' + json.dumps(E()) + "}", b"x"),
     {"header.duplicate_key"}, ERROR),
    ("duplicate_field", mk('{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
     {"header.duplicate_key"}, ERROR),
    ("duplicate_metadata", mk('{"__metadata__":{"format":"pt"},"__metadata__":{"format":"pt"}}'),
     {"header.duplicate_key"}, ERROR),
    ("bad_json_truncated", mk('{"a":'), {"header.bad_json"}, ERROR),
    ("bad_json_nan", mk('{"a":' + json.dumps(E())[:-1] + ',"x":NaN}}', b"x"), {"header.bad_json"}, ERROR),
    ("bad_json_infinity", mk('{"a":' + json.dumps(E())[:-1] + ',"x":-Infinity}}', b"x"), {"header.bad_json"}, ERROR),
    ("bad_json_float_overflow", mk('{"a":' + json.dumps(E())[:-1] + ',"x":1e999}}', b"x"), {"header.bad_json"}, ERROR),
    ("bad_json_lone_surrogate_key", mk('{"\\ud800":' + json.dumps(E()) + "}", b"x"), {"header.bad_json"}, ERROR),
    ("bad_json_lone_surrogate_meta", mk('{"__metadata__":{"format":"\\udc00"}}'), {"header.bad_json"}, ERROR),
    ("bad_json_too_deep", mk('{"a":' + json.dumps(E())[:-1] + ',"x":' + "[" * 126 + "]" * 126 + "}}", b"x"),
     {"header.bad_json"}, ERROR),
    ("bad_json_huge_int", mk('{"a":' + json.dumps(E())[:-1] + ',"x":' + "9" * 5000 + "}}", b"x"),
     {"header.bad_json"}, ERROR),
    ("bad_json_huge_int_offset", mk('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,' + "1" * 4301 + "]}}", b"x"),
     {"header.bad_json"}, ERROR),
    ("bad_json_very_deep", mk('{"a":' + "[" * 100_000), {"header.bad_json"}, ERROR),
    ("bad_padding_nul", mk(b"{}\x00\x00\x00\x00\x00\x00", pad=False), {"header.bad_padding"}, ERROR),
    ("bad_padding_text", mk("{}garbage"), {"header.bad_padding"}, ERROR),
    ("bad_padding_second_object", mk("{}{}"), {"header.bad_padding"}, ERROR),
    ("whitespace_padding", mk("{}\n\t    ", pad=False), {"header.whitespace_padding"}, WARNING),
    ("metadata_tensor", mk({"__metadata__": E()}, b"x"), {"header.metadata_tensor"}, ERROR),
    ("bad_metadata_int", mk({"__metadata__": {"format": "pt", "n": 1}}), {"header.bad_metadata"}, ERROR),
    ("bad_metadata_list", mk({"__metadata__": ["pt"]}), {"header.bad_metadata"}, ERROR),
    ("bad_metadata_nested", mk({"__metadata__": {"format": {"a": "b"}}}), {"header.bad_metadata"}, ERROR),
    ("format_missing", mk({"__metadata__": {"source": "x"}}), {"header.format_missing"}, WARNING),
    ("format_unknown", mk({"__metadata__": {"format": "tf"}}), {"header.format_unknown"}, WARNING),
    ("bad_entry_int", mk({"a": 1}), {"header.bad_entry"}, ERROR),
    ("bad_entry_missing_offsets", mk({"a": {"dtype": "U8", "shape": [1]}}, b"x"), {"header.bad_entry"}, ERROR),
    ("extra_field", mk({"a": E(foo=1)}, b"x"), {"header.extra_field"}, WARNING),
    ("unknown_dtype", mk({"a": E("F128")}, b"x"), {"header.unknown_dtype"}, ERROR),
    ("unknown_dtype_lowercase", mk({"a": E("u8")}, b"x"), {"header.unknown_dtype"}, ERROR),
    ("unknown_dtype_not_string", mk({"a": E(8)}, b"x"), {"header.unknown_dtype"}, ERROR),
    ("bad_shape_string", mk({"a": E(shape="1")}, b"x"), {"header.bad_shape"}, ERROR),
    ("bad_shape_float", mk({"a": E(shape=[1.0])}, b"x"), {"header.bad_shape"}, ERROR),
    ("bad_shape_bool", mk({"a": E(shape=[True])}, b"x"), {"header.bad_shape"}, ERROR),
    ("bad_shape_nested", mk({"a": E(shape=[[1]])}, b"x"), {"header.bad_shape"}, ERROR),
    ("bad_shape_negative_zero", mk('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
     {"header.bad_shape"}, ERROR),
    ("negative_shape", mk({"a": E(shape=[-1])}, b"x"), {"header.negative_shape"}, ERROR),
    ("bad_offsets_one", mk({"a": E(offsets=[0])}, b"x"), {"header.bad_offsets"}, ERROR),
    ("bad_offsets_three", mk({"a": E(offsets=[0, 1, 1])}, b"x"), {"header.bad_offsets"}, ERROR),
    ("bad_offsets_reversed", mk({"a": E(offsets=[1, 0])}, b"x"), {"header.bad_offsets"}, ERROR),
    ("bad_offsets_negative", mk({"a": E(offsets=[-1, 0])}, b"x"), {"header.bad_offsets"}, ERROR),
    ("bad_offsets_float", mk({"a": E(offsets=[0, 1.0])}, b"x"), {"header.bad_offsets"}, ERROR),
    ("bad_offsets_negative_zero", mk('{"a":{"dtype":"U8","shape":[1],"data_offsets":[-0,1]}}', b"x"),
     {"header.bad_offsets"}, ERROR),
    ("bad_offsets_object", mk({"a": E(offsets={"begin": 0})}, b"x"), {"header.bad_offsets"}, ERROR),
    ("overflow", mk({"a": E(shape=[2**30, 2**30])}, b"x"), {"header.overflow"}, ERROR),
    ("overflow_2_64", mk({"a": E(shape=[2**64 + 1])}, b"x"), {"header.overflow"}, ERROR),
    ("misaligned_slice_f4", mk({"a": E("F4", [3], [0, 2])}, b"xy"), {"header.misaligned_slice"}, ERROR),
    ("misaligned_slice_f6", mk({"a": E("F6_E2M3", [1], [0, 1])}, b"x"), {"header.misaligned_slice"}, ERROR),
    ("size_mismatch", mk({"a": E("F32", [2], [0, 4])}, b"xxxx"), {"header.size_mismatch"}, ERROR),
    ("size_mismatch_zero_size", mk({"a": E("F32", [0], [0, 4])}, b"xxxx"), {"header.size_mismatch"}, ERROR),
    ("offset_hole_first", mk({"a": E(offsets=[1, 2])}, b"xx"), {"header.offset_hole"}, ERROR),
    ("offset_hole_between", mk({"a": E(), "b": E(offsets=[2, 3])}, b"xxx"), {"header.offset_hole"}, ERROR),
    ("offset_overlap", mk({"a": E(shape=[2], offsets=[0, 2]), "b": E(offsets=[1, 2])}, b"xx"),
     {"header.offset_overlap"}, ERROR),
    ("offset_overlap_same", mk({"a": E(), "b": E()}, b"x"), {"header.offset_overlap"}, ERROR),
    ("trailing_bytes", mk({"a": E()}, b"xy"), {"header.trailing_bytes"}, ERROR),
    ("trailing_bytes_no_tensors", mk("{}", b"\x00"), {"header.trailing_bytes"}, ERROR),
    ("truncated", mk({"a": E(shape=[2], offsets=[0, 2])}, b"x"), {"header.truncated"}, ERROR),
    ("truncated_empty_data", mk({"a": E("F32", [4], [0, 16])}), {"header.truncated"}, ERROR),
    ("unaligned_header", mk("{}", pad=False), {"header.unaligned_header"}, WARNING),
    ("unaligned_tensor", mk({"a": E(shape=[3], offsets=[0, 3]), "b": E("F32", [1], [3, 7])}, b"x" * 7),
     {"header.unaligned_tensor"}, WARNING),
]


def _codes(hdr) -> set[str]:
    return {f.code for f in hdr.findings}


@FAST
@pytest.mark.parametrize("name,blob,codes,severity", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_precise_code(name: str, blob: bytes, codes: set[str], severity: str, tmp_path: Path,
                                fast: bool) -> None:
    hdr = parse(blob, fast, path="x.safetensors")
    assert _codes(hdr) == codes, [f.message for f in hdr.findings]
    assert {f.severity for f in hdr.findings} == {severity}
    assert hdr.ok == (severity != ERROR)
    for f in hdr.findings:
        assert f.path == "x.safetensors" and f.message and f.hint
    # The file reader says exactly the same as the in-memory parser.
    p = tmp_path / "x.safetensors"
    p.write_bytes(blob)
    from_file = read_header(p, display="x.safetensors", fast=fast)
    assert [(f.code, f.severity, f.tensor) for f in from_file.findings] == \
        [(f.code, f.severity, f.tensor) for f in hdr.findings]
    if severity == ERROR:
        with pytest.raises(InputError) as exc:
            load_header(p, display="x.safetensors", fast=fast)
        assert any(c in exc.value.message for c in codes)
    else:
        assert load_header(p, display="x.safetensors", fast=fast).findings == from_file.findings


# ckptctl is stricter than safetensors on purpose only here: identical duplicate keys open in
# safetensors 0.8 (one copy wins) but parsers disagree on them (safetensors #401).
STRICTER_THAN_SAFETENSORS = {"duplicate_key"}


def test_malformed_agrees_with_safe_open(tmp_path: Path) -> None:
    """Where safetensors refuses a file, ckptctl reports an error; where ckptctl only warns,
    safetensors opens it; ckptctl errs on a file safetensors opens only where documented."""
    p = tmp_path / "x.safetensors"
    stricter = set()
    for name, blob, codes, severity in MALFORMED:
        p.write_bytes(blob)
        if _safe_open_ok(p):
            if severity == ERROR:
                stricter.add(name)
        else:
            assert severity == ERROR, f"safetensors rejects {name} but ckptctl only warns"
    assert stricter == STRICTER_THAN_SAFETENSORS


def test_serde_depth_limit_boundary() -> None:
    """127 nested levels are the most serde_json (and so safetensors) reads; ckptctl agrees."""
    def deep(levels: int) -> bytes:
        inner = levels - 2  # the top object and the tensor entry are two levels
        return mk('{"a":' + json.dumps(E())[:-1] + ',"x":' + "[" * inner + "]" * inner + "}}", b"x")

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.safetensors"
        for levels, ok in ((127, True), (128, False)):
            p.write_bytes(deep(levels))
            assert _safe_open_ok(p) is ok
            assert parse(deep(levels)).ok is ok


@FAST
def test_hub_limit_warning(tmp_path: Path, fast: bool) -> None:
    blob = mk("{}" + " " * 25_000_006)
    hdr = parse(blob, fast)
    assert [(f.code, f.severity) for f in hdr.findings] == [("header.hub_limit", WARNING)]
    p = tmp_path / "big.safetensors"
    p.write_bytes(blob)
    assert [(f.code, f.severity) for f in read_header(p, fast=fast).findings] == [("header.hub_limit", WARNING)]


def test_several_problems_are_all_reported() -> None:
    header = {
        "__metadata__": {"note": "no format"},
        "bad_dtype": E("Q7", [1], [0, 1]),
        "neg": E(shape=[-2], offsets=[1, 3]),
        "rev": E(offsets=[9, 4]),
        "extra": E(shape=[1], offsets=[1, 2], why="x"),
        "sized": E("F32", [3], [2, 6]),
        "late": E("U8", [2], [9, 11]),  # starts after a gap (data ends at 6 before it)
        "inside": E("U8", [1], [10, 11]),  # starts inside "late"
    }
    hdr = parse(mk(header, b"x" * 11))
    got = {(f.code, f.tensor) for f in hdr.findings}
    assert got >= {
        ("header.format_missing", None),
        ("header.unknown_dtype", "bad_dtype"),
        ("header.negative_shape", "neg"),
        ("header.bad_offsets", "rev"),
        ("header.extra_field", "extra"),
        ("header.size_mismatch", "sized"),
        ("header.offset_hole", "late"),
        ("header.offset_overlap", "inside"),
    }, got
    assert not hdr.ok


@FAST
def test_valid_tensors_are_returned_in_offset_order(fast: bool) -> None:
    blob = mk({"b": E(offsets=[1, 2]), "a": E()}, b"xy")
    assert fast_taken(blob)
    hdr = parse(blob, fast)
    assert hdr.ok and hdr.findings == []
    assert list(hdr.tensors) == ["a", "b"]
    assert hdr.data_bytes == 2


@FAST
def test_read_header_missing_file_raises(tmp_path: Path, fast: bool) -> None:
    # a file missing when its header is read vanished mid-operation (a missing input is refused
    # before, exit 2): an I/O failure, exit 3 (issue 15)
    with pytest.raises(OperationalError) as err:
        read_header(tmp_path / "absent.safetensors", fast=fast)
    assert err.value.exit_code == 3 and "no such file or directory" in err.value.message


# ------------------------------------------------------------------------------------------
# Fuzzing


def _safe_open_ok(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())
        return True
    except Exception:  # noqa: BLE001 - safetensors raises SafetensorError and others
        return False


def _check_findings(hdr) -> None:
    assert isinstance(hdr.findings, list)
    for f in hdr.findings:
        assert f.code.startswith("header.") and f.severity in (ERROR, WARNING, "info")
        assert isinstance(f.message, str)


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_bytes_never_raise(blob: bytes) -> None:
    _check_findings(parse(blob))


@FUZZ
@given(st.integers(0, 2**64 - 1), st.binary(max_size=200))
def test_fuzz_length_field_never_raises(n: int, tail: bytes) -> None:
    hdr = parse(struct.pack("<Q", n) + tail)
    _check_findings(hdr)
    if n > len(tail):
        assert not hdr.ok


@FAST
@pytest.mark.parametrize("n", [2**63, 2**64 - 1, MAX_HEADER_SIZE, MAX_HEADER_SIZE - 1, 99_999_992, 10**7])
def test_length_field_is_never_allocated(n: int, tmp_path: Path, fast: bool) -> None:
    """A small file claiming a huge header is refused from its size, before any read."""
    p = tmp_path / "liar.safetensors"
    p.write_bytes(struct.pack("<Q", n) + b'{"a":1}')
    tracemalloc.start()
    try:
        hdr = read_header(p, fast=fast)
        parsed = parse_header_bytes(p.read_bytes(), fast=fast)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    assert not hdr.ok and not parsed.ok
    assert _codes(hdr) == _codes(parsed) == {"header.too_large" if n > MAX_HEADER_SIZE
                                             else "header.length_exceeds_file"}


def _valid_file() -> bytes:
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "model.embed.weight": make_tensor(dt.BY_NAME["BF16"], (4, 3), gen),
        "model.norm.weight": make_tensor(dt.BY_NAME["F32"], (3,), gen),
        "scale": make_tensor(dt.BY_NAME["F8_E4M3"], (5,), gen),
        "ids": make_tensor(dt.BY_NAME["I64"], (2,), gen),
        "empty": torch.empty(0, 2),
        "s": torch.tensor(1.0, dtype=torch.float16),
        "mask": make_tensor(dt.BY_NAME["BOOL"], (3,), gen),
    }
    return save(tensors, metadata={"format": "pt"})


VALID = _valid_file()
VALID_HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]
_FUZZ_DIR = tempfile.mkdtemp(prefix="ckptctl-fuzz-")
STRUCTURAL = [i + 1 for i in range(8, VALID_HEADER_END) if VALID[i:i + 1] in (b"{", b"[", b",", b":")]

_byte_ops = st.one_of(
    st.tuples(st.just("set"), st.integers(0, VALID_HEADER_END + 8), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, VALID_HEADER_END + 8), st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("delete"), st.integers(0, VALID_HEADER_END + 8), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID)), st.just(0)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=9), st.just(0)),
    # JSON tokens spliced into the header right after a '{', '[', ',' or ':' with the length
    # field kept in step: the JSON often stays parseable, which exercises the rules rather than
    # the syntax errors.
    st.tuples(st.just("token"), st.sampled_from(STRUCTURAL) | st.integers(9, VALID_HEADER_END), st.sampled_from([
        b"NaN,", b"-Infinity,", b"1e999,", b"-0,", b"0,", b"-1,", b"1.0,", b"2,", b"null,", b"true,",
        b'"\\ud800",', b'"\\udc00\\ud800":1,', b"[" * 130, b"]", b"[", b",", b":", b'"', b"{", b"}",
        b'"x":1,', b'"x":NaN,', b'"x":-0,', b'"x":1e400,', b'"\\udfff":1,', b'"x":' + b"[" * 126 + b"]" * 126 + b",",
        b'"x":' + b"[" * 125 + b"]" * 125 + b",", b" ", b"\n", b"\x00", b"\xff", b"\xc3\xa9",
        b'"__metadata__":{},', b'"__metadata__":null,', b"9" * 4400 + b",", b'"x":' + b"1" * 4400 + b",", b'"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},',
    ])),
)


def _apply_bytes(blob: bytes, op: tuple) -> bytes:
    kind, a, b = op
    if kind == "set":
        a %= max(1, len(blob))
        return blob[:a] + bytes([b]) + blob[a + 1:]
    if kind == "insert":
        return blob[:a] + b + blob[a:]
    if kind == "delete":
        return blob[:a] + blob[a + b:]
    if kind == "truncate":
        return blob[:a]
    if kind == "token":
        (n,) = struct.unpack("<Q", blob[:8]) if len(blob) >= 8 else (0,)
        if 8 <= a <= 8 + n <= len(blob):
            return struct.pack("<Q", n + len(b)) + blob[8:a] + b + blob[a:]
        return blob[:a] + b + blob[a:]
    return blob + a


def _differential(blob: bytes) -> None:
    hdr = parse(blob)
    _check_findings(hdr)
    p = Path(_FUZZ_DIR) / "m.safetensors"
    p.write_bytes(blob)
    for fast in (True, False):
        file_hdr = read_header(p, fast=fast)
        assert [f.code for f in file_hdr.findings] == [f.code for f in hdr.findings]
    if not _safe_open_ok(p):
        assert not hdr.ok, f"safe_open rejects but ckptctl reports {[f.code for f in hdr.findings]}"


@FUZZ
@given(st.lists(_byte_ops, min_size=1, max_size=4))
def test_fuzz_byte_mutations_differential(ops: list) -> None:
    blob = VALID
    for op in ops:
        blob = _apply_bytes(blob, op)
    _differential(blob)


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


# Leaves Python's json reads but serde_json refuses (or only just accepts): NaN/Infinity, lone
# surrogate escapes, nesting at serde's depth limit, -0.
_special = st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, "\ud800", "x\udfff",
                            _nested(125), _nested(126), 2**64, 2**64 - 1])
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=4) | st.text(st.characters(), max_size=3)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**66) | st.floats() | _text | _special
    | st.sampled_from([d.name for d in dt.DTYPES] + ["__metadata__", "pt"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def _json_mutation(draw) -> bytes:
    (n,) = struct.unpack("<Q", VALID[:8])
    obj = json.loads(VALID[8:8 + n])
    data = VALID[8 + n:]
    for _ in range(draw(st.integers(1, 2))):
        if not obj:
            break
        key = draw(st.sampled_from(sorted(obj)))
        action = draw(st.sampled_from(["replace_entry", "replace_field", "nudge", "drop_field", "add_field",
                                       "add_field", "add_field", "rename", "drop_entry", "dtype"]))
        entry = obj[key]
        if action == "replace_entry":
            obj[key] = draw(_json_values)
        elif not isinstance(entry, dict) or not entry:
            continue
        elif action == "replace_field":
            obj[key][draw(st.sampled_from(sorted(entry)))] = draw(_json_values)
        elif action == "nudge":
            field = draw(st.sampled_from(["shape", "data_offsets"]))
            vals = entry.get(field)
            if isinstance(vals, list) and vals:
                i = draw(st.integers(0, len(vals) - 1))
                if isinstance(vals[i], int):
                    vals[i] += draw(st.integers(-3, 3))
        elif action == "drop_field":
            entry.pop(draw(st.sampled_from(sorted(entry))))
        elif action == "add_field":
            entry[draw(st.text(max_size=5))] = draw(_json_values)
        elif action == "rename":
            obj[draw(st.text(max_size=4))] = obj.pop(key)
        elif action == "drop_entry":
            obj.pop(key)
        elif action == "dtype" and "dtype" in entry:
            entry["dtype"] = draw(st.sampled_from([d.name for d in dt.DTYPES]))
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()), allow_nan=True).encode("utf-8", "surrogatepass")
    # Mostly keep the padding and the data right, so that one oddity is not masked by another.
    if draw(st.integers(0, 3)):
        text += b" " * (-len(text) % 8)
    else:
        text += draw(st.sampled_from([b"", b" ", b"  ", b"\n", b"\x00"])) * draw(st.integers(0, 9))
    if not draw(st.integers(0, 3)):
        data = data[:draw(st.integers(0, len(data)))] + draw(st.binary(max_size=3))
    return struct.pack("<Q", len(text)) + text + data


@FUZZ
@given(_json_mutation())
def test_fuzz_json_mutations_differential(blob: bytes) -> None:
    _differential(blob)


def test_valid_file_passes_both() -> None:
    p = Path(_FUZZ_DIR) / "valid.safetensors"
    p.write_bytes(VALID)
    assert _safe_open_ok(p)
    assert fast_taken(VALID)
    assert parse(VALID).findings == []


def teardown_module() -> None:
    for name in os.listdir(_FUZZ_DIR):
        os.unlink(os.path.join(_FUZZ_DIR, name))
    os.rmdir(_FUZZ_DIR)


def test_a_header_read_without_following_links_or_past_a_limit(tmp_path: Path) -> None:
    """``read_header_bytes(follow=False)`` does not open a link; ``limit``: a header longer than
    it is not read (no bytes, no finding, its length known), one within it is read as without."""
    from ckptctl.format.header import read_header_bytes

    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3)}, str(f))
    n = int.from_bytes(f.read_bytes()[:8], "little")
    (tmp_path / "link.safetensors").symlink_to(f)
    with pytest.raises(OperationalError):
        read_header_bytes(tmp_path / "link.safetensors", follow=False)
    assert read_header_bytes(tmp_path / "link.safetensors")[1] == f.read_bytes()[8:8 + n]
    hdr, raw = read_header_bytes(f, limit=n - 1)
    assert raw is None and hdr.header_len == n and not hdr.findings
    assert read_header_bytes(f, follow=False, limit=n)[1] == f.read_bytes()[8:8 + n]


@pytest.mark.parametrize("fast", [True, False])
def test_a_kept_header_text_is_left_as_read_and_decodes_the_same(tmp_path: Path, fast: bool) -> None:
    """``decode_header(keep=True)`` (a reading keeps the bytes to compare later reads with)
    leaves them as they were read; without it they are emptied. Both decode the same header."""
    from ckptctl.format.header import decode_header, read_header_bytes

    p = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, str(p), metadata={"format": "pt"})
    kept_hdr, kept = read_header_bytes(p)
    before = bytes(kept)
    decode_header(kept_hdr, kept, fast=fast, keep=True)
    hdr, raw = read_header_bytes(p)
    decode_header(hdr, raw, fast=fast)
    assert kept == before and raw == bytearray()
    assert kept_hdr.tensors.specs() == hdr.tensors.specs() and kept_hdr.metadata == hdr.metadata == {"format": "pt"}
    assert not hdr.findings and not kept_hdr.findings
