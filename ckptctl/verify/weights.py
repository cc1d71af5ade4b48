"""Weights files: each header or pickle read once, the tensors of a family merged.

Header findings come from :mod:`ckptctl.format.header` (every rule of the format), pickle findings
from :mod:`ckptctl.verify.pickles`; this module adds what is about the tensors of a family: dtype
notes, a tensor stored in two files, alias records that name nothing, shards over
``--max-shard-size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from ckptctl import layout as L
from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format import dtypes as dt
from ckptctl.format.header import Header, MergedSpecs
from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.context import Context, FamilyTensors, WeightsRead

# Header findings after which the header holds no tensor list at all.
_UNPARSED = frozenset({"header.lfs_pointer", "header.html_page", "header.too_small", "header.too_large",
                       "header.length_exceeds_file", "header.not_utf8", "header.not_object",
                       "header.duplicate_key", "header.bad_json", "header.not_a_file"})
_RESERVED_META = frozenset({"format", "total_size", "total_parameters"})


def transformers_rank(fam: L.Family) -> int:
    """transformers' order of precedence among the families of one directory (lowest first):
    ``model.safetensors``, a safetensors index, other safetensors, a pickle, a pickle index."""
    if fam.container == L.SAFETENSORS:
        return 0 if fam.files == ["model.safetensors"] and not fam.index else (1 if fam.index else 2)
    return 3 if not fam.index else 4


def _version(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split("."))


def dtype_notes(hdr: Header) -> list[Finding]:
    out: list[Finding] = []
    newer: dict[str, str] = {}
    no_torch: list[str] = []
    used = hdr.tensors.dtype_set()  # a few dtypes, many tensors: told by column
    for d in filter(None, map(dt.get, used)):
        if _version(d.since) > (0, 4):
            newer[d.name] = d.since
    odd = {d for d in used if (x := dt.get(d)) is not None and x.torch_name is None}
    if odd:
        no_torch = [t.name for t in hdr.tensors.values() if t.spec.dtype in odd]
    if newer:
        need = max(newer.values(), key=_version)
        out.append(Finding("header.dtype_min_version", INFO, hdr.path,
                           f"{hdr.path}: dtypes {', '.join(sorted(newer))} need safetensors >= {need} to load",
                           "make sure every consumer has that safetensors version", None,
                           {"dtypes": dict(sorted(newer.items()))}))
    if no_torch:
        out.append(Finding("header.dtype_not_torch", WARNING, hdr.path,
                           f"{hdr.path}: {len(no_torch)} tensors use a dtype torch cannot load (F6_*), e.g. "
                           f"{no_torch[0]!r}", "convert them before loading with safetensors.torch", no_torch[0]))
    return out


def alias_records(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """The entries of a metadata map that read as alias records ``{removed: kept}``
    (huggingface_hub / safetensors ``save_model``): two names with the same last part."""
    out = []
    for k, v in meta.items():
        if k in _RESERVED_META or not isinstance(k, str) or not isinstance(v, str) or k == v:
            continue
        if "." not in k or "." not in v or k.rsplit(".", 1)[1] != v.rsplit(".", 1)[1] or " " in v:
            continue
        out.append((k, v))
    return out


def alias_findings(meta: dict[str, Any], names: Set[str], display: str) -> list[Finding]:
    """Alias records must name a tensor that is stored."""
    out: list[Finding] = []
    for k, v in alias_records(meta):
        if k not in names and v not in names:
            out.append(Finding("metadata.alias_dangling", WARNING, display,
                               f"{display}: metadata records {k!r} as an alias of {v!r}, which is not stored",
                               "re-export the checkpoint: the alias map is stale", k, {"kept": v}))
    return out


def read_file(ctx: Context, name: str, container: str) -> WeightsRead:
    """Read one weights file (header or pickle) once; its findings are reported the first time."""
    if name in ctx.reads:
        return ctx.reads[name]
    out = ctx.reads[name] = WeightsRead(None, {})
    ctx.record(name, "weights")
    if ctx.regular_size(name, "replace it with the weights file") is None:
        return out
    path = shown = ctx.disp(name)  # (the file as shown: root / name, made once)
    try:
        if container == L.SAFETENSORS:
            hdr = out.header = ctx.deep_queue[name] = ctx.reading.header(path, display=shown)
            ctx.extend(hdr.findings)
            ctx.extend(dtype_notes(hdr))
            if not any(f.code in _UNPARSED for f in hdr.findings):
                # views of the header's columns, never a second table of every tensor
                held = hdr.tensors.keys()
                extra = {f.tensor for f in hdr.findings if f.tensor and f.tensor not in held}
                out.names = held | extra if extra else held
                out.tensors = hdr.tensors.specs()
        else:
            from ckptctl.verify.pickles import scan_torch_file

            scan = scan_torch_file(str(path), shown)
            ctx.deep_queue[name] = None
            ctx.extend(scan.findings)
            if scan.tensors is not None:
                out.names = set(scan.tensors)
                out.tensors = {k: s for k, s in scan.tensors.items() if k not in scan.aliases}
    except (OSError, CkptctlError) as exc:
        ctx.io(name, exc)
    return out


def merge(ctx: Context, reads: dict[str, WeightsRead], *, where: dict[str, str] | None = None,
          disjoint: bool = False) -> Mapping[str, TensorSpec]:
    """All tensors of a family; a name stored in two files is an error. ``where``: each stored
    name to its file, proven so by the caller (an index that agrees with every file, each file's
    names its tensors'): the merged view's index of names, not built again. ``disjoint``: the
    caller proved so that no name is in two files, without such an index at hand (a look-up by
    name then asks each file's table in turn)."""
    if len(reads) == 1:  # one file: its own table (a name cannot repeat in it)
        return next(iter(reads.values())).tensors
    # No name in two files: the first-wins table below is each file's own, side by side (an index
    # of names; a header's spec made only when a rule asks for it).
    merged = MergedSpecs([r.tensors for r in reads.values()], keys=list(reads), where=where,
                         disjoint=True if disjoint else None)  # keyed by file
    if _no_name_twice(reads, merged):
        return merged
    table: dict[str, TensorSpec] = {}
    where: dict[str, list[str]] = {}
    for name, r in reads.items():
        for t in sorted(r.names or ()):
            where.setdefault(t, []).append(name)
        for t, spec in r.tensors.items():
            table.setdefault(t, spec)
    for t, files in sorted(where.items()):
        if len(files) > 1:
            ctx.add("dir.duplicate_tensor", ERROR, ctx.disp(),
                    f"tensor {t!r} is stored in {len(files)} files ({', '.join(files)}); which copy a loader "
                    "uses depends on the loader", "run `ckptctl resave --repair` to keep one copy",
                    tensor=t, files=files)
    return table


def _no_name_twice(reads: dict[str, WeightsRead], merged: MergedSpecs) -> bool:
    """No name is in two files. A file's names hold its tensors' (and a pickle's aliases, a
    header's names that only a finding mentions): when no file has more, the merged view's own
    index answers; else every name is collected."""
    if all(len(r.names or ()) == len(r.tensors) for r in reads.values()):
        return merged.disjoint
    return len(set().union(*(r.names or () for r in reads.values()))) == sum(len(r.names or ()) for r in reads.values())


def shard_sizes(ctx: Context, reads: dict[str, WeightsRead]) -> None:
    limit = ctx.options.max_shard_size
    if not limit:
        return
    for name, r in reads.items():
        if r.header is None or len(r.header.tensors) < 2:
            continue
        if r.header.data_bytes > limit:
            ctx.add("dir.shard_too_large", WARNING, ctx.disp(name),
                    f"{name} holds {r.header.data_bytes:,} tensor bytes, over --max-shard-size {limit:,}",
                    "re-shard with `ckptctl resave --max-shard-size`", size=r.header.data_bytes, limit=limit)


def read_family(ctx: Context, fam: L.Family, *, complete: bool = True) -> FamilyTensors:
    """A family without a usable index: every file layout grouped into it."""
    reads = {n: read_file(ctx, n, fam.container) for n in fam.files}
    table = merge(ctx, reads)
    if len(fam.files) == 1:
        hdr = reads[fam.files[0]].header
        if hdr is not None and hdr.metadata:
            ctx.extend(alias_findings(hdr.metadata, hdr.tensors.keys(), hdr.path))
    shard_sizes(ctx, reads)
    return FamilyTensors(fam, table, complete and all(r.names is not None for r in reads.values()))
