"""What a safetensors header must satisfy: the :class:`Header` both readers fill, the format's
limits, and the rules that turn what a reader found (the metadata, the padding, each entry, the
table of tensors) into findings. The strict reader (:mod:`ckptctl.format.header`) and the fast
one (:mod:`ckptctl.format.header_fast`) share every rule here, so the same table and metadata
give the same findings whichever read them.

Validation is at least as strict as the safetensors Rust crate (``Metadata::validate``) and adds
what the crate lets through (duplicate keys, non-space padding, a git-LFS pointer or HTML page in
place of a shard, a tensor named ``__metadata__``, unaligned offsets). Every problem is a
:class:`~ckptctl.findings.Finding` with its own code, and all problems of a file are reported.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ckptctl.findings import ERROR, WARNING, Finding, has_errors
from ckptctl.format import dtypes as dt
from ckptctl.format.table import TensorInfo, TensorTable
from ckptctl.format.tensor import TensorSpec

MAX_HEADER_SIZE = 100_000_000  # safetensors' MAX_HEADER_SIZE
HUB_MAX_HEADER_SIZE = 25_000_000  # huggingface_hub refuses larger headers in its metadata API
MAX_DIM_PRODUCT = 1 << 48  # the schema's limit on sizes
VALID_FORMATS = ("pt", "mlx")
METADATA_KEY = "__metadata__"
REDOWNLOAD = "the file is damaged or incomplete: download or export it again"


@dataclass
class Header:
    """A parsed header. ``tensors`` is in data-offset order; ``findings`` lists every problem."""

    path: str
    file_size: int
    header_len: int = 0
    tensors: TensorTable = field(default_factory=TensorTable.empty)
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
        return self.tensors.data_bytes

    def add(self, code: str, message: str, *, severity: str = ERROR, tensor: str | None = None,
            hint: str | None = None, **details: Any) -> None:
        self.findings.append(
            Finding(code, severity, self.path, message, hint, tensor, dict(details))
        )

    def copy(self, path: str | None = None) -> "Header":
        """The same reading, shown as ``path``, sharing nothing mutable but the (read-only) table.
        Findings name the path they were made for: only a header without findings, or one
        shown at its own path, may be copied to another."""
        shown = self.path if path is None else path
        assert shown == self.path or not self.findings, "a header's findings name its path"
        return Header(shown, self.file_size, self.header_len, self.tensors,
                      None if self.metadata is None else dict(self.metadata), list(self.findings))



def check_padding(hdr: Header, padding: str) -> None:
    """What follows the JSON object: only spaces are allowed."""
    if not padding.strip(" "):
        return
    shown = hdr.path
    if padding.strip(" \t\r\n"):
        bad = next(c for c in padding if c not in " \t\r\n")
        hdr.add("header.bad_padding",
                f"{shown}: header is padded with {bad!r} after the JSON object (only spaces are allowed)",
                hint="safetensors refuses this file: re-export it")
    else:
        hdr.add("header.whitespace_padding",
                f"{shown}: header padding contains tabs or newlines (the format allows only spaces)",
                severity=WARNING, hint="re-save the file with ckptctl resave")


def check_metadata(hdr: Header, meta: Any) -> None:
    """The ``__metadata__`` value (None: absent, or JSON null): a map of strings to strings,
    with a ``format`` loaders know."""
    shown = hdr.path
    if meta is None:
        return
    if isinstance(meta, dict) and {"dtype", "shape", "data_offsets"} <= set(meta):
        hdr.add("header.metadata_tensor",
                f"{shown}: a tensor is named {METADATA_KEY!r}; safetensors cannot read it back",
                tensor=METADATA_KEY, hint="rename the tensor and re-export")
    elif not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
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


def validate_layout(hdr: Header, table: TensorTable) -> None:
    """Holes, overlaps, trailing bytes, truncation and alignment of the tensors (in offset order)."""
    shown = hdr.path
    begin, end = table._begin, table._end
    if table._contiguous or ((not begin or begin[0] == 0) and all(map(operator.eq, islice(begin, 1, None), end))):
        expected = end[-1] if end else 0  # contiguous from 0: nothing to report
    else:
        expected = 0
        for t in table.values():
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
                    hint=REDOWNLOAD, data_end=expected, data_len=data_len)
    if hdr.header_len % 8:
        hdr.add("header.unaligned_header",
                f"{shown}: header length {hdr.header_len} is not a multiple of 8", severity=WARNING,
                hint="tensors may be misaligned for zero-copy loaders; ckptctl resave aligns them")
    else:
        # the data section starts at a multiple of 8, so a tensor is aligned when its begin is a
        # multiple of its element size (1, 2, 4 or 8 bytes; 1 for sub-byte or unknown dtypes)
        sizes = [(d.bits >> 3) if (d := dt.BY_NAME.get(dtype)) and d.bits >= 8 else 1
                 for dtype, _ in table.kinds]
        if any(map(operator.mod, begin, map(sizes.__getitem__, table.kind_codes))):
            start = hdr.data_start
            for t in table.values():
                size = sizes[table.kind_codes[table.row_of(t.name)]]
                if (start + t.begin) % size:
                    hdr.add("header.unaligned_tensor",
                            f"{shown}: tensor {t.name!r} starts at byte {start + t.begin}, "
                            f"not a multiple of its {size}-byte element", severity=WARNING,
                            tensor=t.name, hint="ckptctl resave lays tensors out aligned")
    hdr.tensors = table


def check_entry(hdr: Header, name: str, entry: Any) -> TensorInfo | None:
    """One tensor entry as the JSON parser read it: its findings, and its tensor (None when the
    entry holds none)."""
    shown = hdr.path
    if not isinstance(entry, dict):
        hdr.add("header.bad_entry", f"{shown}: entry for tensor {name!r} is not an object", tensor=name,
                hint=REDOWNLOAD)
        return None
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        hdr.add("header.bad_entry", f"{shown}: tensor {name!r} lacks {', '.join(missing)}", tensor=name,
                hint=REDOWNLOAD)
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
                tensor=name, hint=REDOWNLOAD)
        return None
    if any(x < 0 for x in shape):
        hdr.add("header.negative_shape", f"{shown}: tensor {name!r} has a negative dimension in {shape}",
                tensor=name, hint=REDOWNLOAD)
        return None
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in offsets)):
        hdr.add("header.bad_offsets", f"{shown}: tensor {name!r} has data_offsets {offsets!r}, "
                "not two non-negative integers", tensor=name, hint=REDOWNLOAD)
        return None
    begin, end = offsets
    if end < begin:
        hdr.add("header.bad_offsets", f"{shown}: tensor {name!r} ends before it begins "
                f"(data_offsets [{begin}, {end}])", tensor=name, hint=REDOWNLOAD, begin=begin, end=end)
        return None
    numel = 1
    for x in shape:
        numel *= x
        if numel > MAX_DIM_PRODUCT:
            hdr.add("header.overflow", f"{shown}: tensor {name!r} shape {shape} overflows the 2^48 element limit",
                    tensor=name, hint=REDOWNLOAD)
            return None
    info = TensorInfo(TensorSpec(name, dtype if isinstance(dtype, str) else "?", tuple(shape)), begin, end)
    if d is not None:
        bits = numel * d.bits
        if bits % 8:
            hdr.add("header.misaligned_slice",
                    f"{shown}: tensor {name!r} ({d.name} x {numel}) does not fill whole bytes",
                    tensor=name, hint=REDOWNLOAD)
        elif end - begin != bits // 8:
            hdr.add("header.size_mismatch",
                    f"{shown}: tensor {name!r} {d.name}{list(shape)} needs {bits // 8} bytes but "
                    f"data_offsets [{begin}, {end}] span {end - begin}", tensor=name, hint=REDOWNLOAD,
                    begin=begin, end=end, expected=bits // 8)
    return info
