"""Read, validate and encode safetensors headers without torch.

Validation is at least as strict as the safetensors Rust crate (``Metadata::validate``) and adds
what the crate lets through (duplicate keys, non-space padding, a git-LFS pointer or HTML page in
place of a shard, a tensor named ``__metadata__``, unaligned offsets). Every problem is a
:class:`~ckptctl.findings.Finding` with its own code, and all problems of a file are reported.
"""

from __future__ import annotations

import gc
import json
import operator
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from ckptctl.errors import InputError, from_oserror
from ckptctl.findings import ERROR, WARNING, Finding, has_errors
from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import SpecFields, TensorSpec

MAX_HEADER_SIZE = 100_000_000  # safetensors' MAX_HEADER_SIZE
HUB_MAX_HEADER_SIZE = 25_000_000  # huggingface_hub refuses larger headers in its metadata API
MAX_DIM_PRODUCT = 1 << 48  # the schema's limit on sizes
VALID_FORMATS = ("pt", "mlx")
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorInfo(SpecFields):
    """One tensor of a safetensors file: its spec and where its bytes sit. ``begin``/``end`` are
    relative to the data section."""

    spec: TensorSpec
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Header:
    """A parsed header. ``tensors`` is in data-offset order; ``findings`` lists every problem."""

    path: str
    file_size: int
    header_len: int = 0
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
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
        return sum(t.nbytes for t in self.tensors.values())

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
_NEGATIVE_ZERO = re.compile(r"[\[,:]\s*-0")


def _decode(text: str) -> tuple[Any, int]:
    """``raw_decode`` with serde_json's rules. Any failure of the fast decoder (an integer over
    Python's digit limit, bad JSON) is decided again by the strict one, which names the problem."""
    if not _NEGATIVE_ZERO.search(text):
        try:
            return _FAST.raw_decode(text)
        except (ValueError, RecursionError, _BadJson, DuplicateKey):
            pass
    return _STRICT.raw_decode(text)


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
    p = os.fspath(path)
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
            size = st.st_size
            hdr = Header(path=shown, file_size=size)
            prefix = f.read(min(size, 512))
            n = _check_prefix(hdr, prefix)
            if n is None:
                return hdr
            if n <= len(prefix) - 8:
                raw = prefix[8:8 + n]
            else:
                f.seek(8)
                raw = f.read(n)
    except OSError as exc:
        raise from_oserror(exc, "cannot read safetensors file") from None
    if len(raw) != n:  # the file shrank while we read it
        hdr.add("header.length_exceeds_file",
                f"{shown}: header length {n} runs past the end of the file (it changed while being read)",
                hint=_REDOWNLOAD, header_len=n)
        return hdr
    _parse_into(hdr, raw)
    return hdr


def parse_header_bytes(data: bytes, *, path: str = "<bytes>") -> Header:
    """Validate a whole in-memory safetensors file (used by tests and fuzzing); the same checks
    and findings as :func:`read_header`."""
    hdr = Header(path=path, file_size=len(data))
    n = _check_prefix(hdr, data[:512])
    if n is None:
        return hdr
    _parse_into(hdr, data[8:8 + n])
    return hdr


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A header decodes (or encodes) into hundreds of thousands of acyclic objects: the cyclic
    collector would only re-scan them (a third of the parse time at 90k tensors), so it waits
    until the header is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse_into(hdr: Header, raw: bytes) -> None:
    with _no_cyclic_gc():
        _parse_text(hdr, raw)


def _parse_text(hdr: Header, raw: bytes) -> None:
    shown = hdr.path
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        hdr.add("header.not_utf8", f"{shown}: header is not valid UTF-8 (byte {exc.start + 8})",
                hint=_REDOWNLOAD, position=exc.start + 8)
        return
    stripped = text.lstrip(" \t\r\n")
    if not stripped.startswith("{"):
        hdr.add("header.not_object", f"{shown}: header does not start with '{{'", hint=_REDOWNLOAD)
        return
    if len(stripped) != len(text):
        hdr.add("header.leading_whitespace",
                f"{shown}: header has {len(text) - len(stripped)} bytes of whitespace before '{{'",
                severity=WARNING, hint="the format says the header MUST begin with '{'; re-save the file")
    try:
        obj, end = _decode(stripped)
    except DuplicateKey as exc:
        hdr.add("header.duplicate_key", f"{shown}: key {exc.key!r} appears more than once in the header",
                tensor=exc.key, hint="parsers disagree on which copy wins: re-export the file")
        return
    except (json.JSONDecodeError, RecursionError, _BadJson) as exc:
        msg = (exc.msg if isinstance(exc, json.JSONDecodeError)
               else "nesting too deep" if isinstance(exc, RecursionError) else str(exc))
        hdr.add("header.bad_json", f"{shown}: header is not valid JSON: {msg}", hint=_REDOWNLOAD)
        return
    if isinstance(obj, dict):
        # Entries of the usual shape are checked in one tight loop first; they cannot hold
        # anything serde_json refuses (depth 3, and no string escape in the whole header means no
        # lone surrogate), so the serde walk only visits the rest.
        plain = 0 if "\\u" in stripped else _plain_entries(obj)
        rest = obj if not plain else {k: v for k, v in obj.items() if type(v) is not TensorInfo}
        problem = _serde_problem(rest)
    else:
        problem = _serde_problem(obj) if isinstance(obj, list) else None
    if problem:
        hdr.add("header.bad_json", f"{shown}: header is not valid JSON for safetensors: {problem}",
                hint=_REDOWNLOAD)
        return
    padding = stripped[end:]
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
    if not isinstance(obj, dict):
        hdr.add("header.not_object", f"{shown}: header is a JSON {type(obj).__name__}, not an object",
                hint=_REDOWNLOAD)
        return
    _validate_entries(hdr, obj)


def _plain_entries(obj: dict[str, Any]) -> int:
    """Replace, in ``obj``, each entry that :func:`_check_entry` would accept without a finding
    by the :class:`TensorInfo` it would build (found with exact type checks and no per-entry
    call; the entry's dict and lists are freed at once, so a huge header never holds both forms
    of every entry); returns how many. Anything unusual (an unknown key or dtype, a zero
    dimension, a size that does not match) is left to :func:`_check_entry`."""
    out = 0
    by_name, limit = dt.BY_NAME, MAX_DIM_PRODUCT
    for name, entry in obj.items():
        if type(entry) is not dict or len(entry) != 3:
            continue
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if (type(dtype) is not str or type(shape) is not list or type(offsets) is not list
                or len(offsets) != 2 or dtype not in by_name):
            continue
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
            continue
        numel = 1
        for x in shape:
            if type(x) is not int or x < 1:
                break
            numel *= x
        else:  # every dimension >= 1: the running product only grows, so the last one is the largest
            bits = numel * by_name[dtype].bits
            if numel <= limit and not bits % 8 and end - begin == bits >> 3 and name != METADATA_KEY:
                obj[name] = TensorInfo(TensorSpec(name, dtype, tuple(shape)), begin, end)  # same keys: safe
                out += 1
    return out


def _validate_entries(hdr: Header, obj: dict[str, Any]) -> None:
    shown = hdr.path
    meta = obj.get(METADATA_KEY)
    if METADATA_KEY in obj:
        if isinstance(meta, dict) and {"dtype", "shape", "data_offsets"} <= set(meta):
            hdr.add("header.metadata_tensor",
                    f"{shown}: a tensor is named {METADATA_KEY!r}; safetensors cannot read it back",
                    tensor=METADATA_KEY, hint="rename the tensor and re-export")
        elif meta is None:
            pass
        elif not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
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
    entries: list[TensorInfo] = []
    for name, entry in obj.items():
        if name == METADATA_KEY:
            continue
        info = entry if type(entry) is TensorInfo else _check_entry(hdr, name, entry)
        if info is not None:
            entries.append(info)
    entries.sort(key=_offsets)
    expected = 0
    for t in entries:
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
        start, by_name = hdr.data_start, dt.BY_NAME
        for t in entries:
            d = by_name.get(t.spec.dtype)  # type: ignore[arg-type]  # "?" for an unknown one
            if d and d.bits >= 8 and (start + t.begin) % (d.bits >> 3):
                hdr.add("header.unaligned_tensor",
                        f"{shown}: tensor {t.name!r} starts at byte {hdr.data_start + t.begin}, "
                        f"not a multiple of its {d.itemsize}-byte element", severity=WARNING,
                        tensor=t.name, hint="ckptctl resave lays tensors out aligned")
    hdr.tensors = {t.name: t for t in entries}


_offsets = operator.attrgetter("begin", "end")


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
    """The order the official writer lays tensors out in: dtype rank descending, then name."""
    return sorted(specs, key=lambda s: (-dt.RANK[s.dtype], s.name))


def encode_header(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None, *, extra_pad: int = 0
                  ) -> tuple[bytes, list[TensorInfo]]:
    """Header bytes (8-byte length + JSON padded with spaces to a multiple of 8) and the tensors
    with their data offsets, in file order. Byte-identical to ``safetensors.torch.save_file``;
    ``extra_pad`` (a multiple of 8) more spaces move the data section that far (the Rust parser
    accepts trailing whitespace in the JSON: the writer uses it to place tensors where the
    kernel can clone them)."""
    if extra_pad < 0 or extra_pad % 8:
        raise ValueError("extra header padding must be a non-negative multiple of 8")
    with _no_cyclic_gc():
        return _encode(layout_order(specs), metadata, extra_pad)


def _encode(ordered: list[TensorSpec], metadata: dict[str, str] | None, extra_pad: int
            ) -> tuple[bytes, list[TensorInfo]]:
    obj: dict[str, Any] = {}
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError("safetensors metadata must map strings to strings")
        obj[METADATA_KEY] = dict(metadata)
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
        # a plain spec is immutable: the layout shares it instead of building an equal one
        spec = s if type(s) is TensorSpec and type(s.shape) is tuple else TensorSpec(name, s.dtype, tuple(s.shape))
        infos.append(TensorInfo(spec, offset, offset + n))
        offset += n
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    pad = (-len(text)) % 8 + extra_pad
    text += b" " * pad
    if len(text) > MAX_HEADER_SIZE:
        raise ValueError("header too large")
    return struct.pack("<Q", len(text)) + text, infos


def header_size_of(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    """Total bytes of the encoded header (length field included)."""
    return len(encode_header(specs, metadata)[0])


