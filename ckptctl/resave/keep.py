"""Keep-layout resave: every shard of the kept family stays as it is (hard-linked, renamed when
its ``-of-N`` name was wrong); only a shard that must change (a tensor stored twice, trailing
bytes) is rewritten, by kernel copy; the index is rebuilt from the headers. And the test that
the plan is the directory as it already is (a repair with nothing to do)."""

from __future__ import annotations

import hashlib
from math import prod
from pathlib import Path

from ckptctl import layout as L
from ckptctl.errors import UnrepairableError
from ckptctl.format import names as N
from ckptctl.format.header import Header, TensorInfo, encode_header, read_header
from ckptctl.format.index import Index
from ckptctl.manifest import MANIFEST_NAME
from ckptctl.plan import Plan, ShardPlan
from ckptctl.resave.analyze import Chosen, Repair
from ckptctl.sources.base import Source, SourceTensor
from ckptctl.sources.safetensors_source import SafetensorsSource
from ckptctl.write.inputs import Entry, entries_for


def _hash_range(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


# The tensors a keep-layout plan reads, file by file: (path, data start, the file's kept entries).
Kept = list[tuple[str, int, list[TensorInfo]]]


def keep_layout_plan(root: Path, chosen: Chosen, rep: Repair) -> tuple[Plan, Kept]:
    """A plan that keeps each file's tensors together, linking every file that does not change;
    the files keep their library's names and variant. With it, what each file contributes
    (:func:`keep_layout_source` makes the source of it, once the plan is not a no-op)."""
    files = chosen.files
    headers = {n: chosen.headers.get(n) or read_header(root / n, display=str(root / n)) for n in files}
    per_file: dict[str, list[TensorInfo]] = {}
    if len(set().union(*(headers[n].tensors for n in files))) == sum(len(headers[n].tensors) for n in files):
        # no tensor stored twice: every file keeps all its tensors
        per_file = {n: list(headers[n].tensors.values()) for n in sorted(files) if headers[n].tensors}
    else:
        _drop_duplicates(root, headers, per_file, rep)
    if rep.duplicates:
        rep.fixes.append(f"kept {len(rep.duplicates)} tensor(s) stored twice with identical bytes once")
    ordered = sorted(per_file)
    n_out = len(ordered)
    shards: list[ShardPlan] = []
    for i, n in enumerate(ordered, start=1):
        new_name = N.weights_file_name(chosen.stem, N.SAFETENSORS_EXT, variant=chosen.variant,
                                       shard=(i, n_out) if n_out > 1 else None)
        h = headers[n]
        keep = per_file[n]
        unchanged = (len(keep) == len(h.tensors) and h.data_start + h.data_bytes == h.file_size)
        specs = [t.spec for t in keep]
        if unchanged:
            with open(root / n, "rb") as f:
                raw_header = f.read(h.data_start)
            sp = ShardPlan(new_name, specs, h.metadata, raw_header, list(keep), link_from=str(root / n))
            if new_name != n:
                rep.fixes.append(f"renamed {n} to {new_name} (content unchanged)")
        else:
            md = h.metadata if h.metadata is not None else {"format": "pt"}
            header, lay = encode_header(specs, md)
            sp = ShardPlan(new_name, specs, md, header, lay)
            if h.data_start + h.data_bytes != h.file_size:
                rep.fixes.append(f"dropped {h.file_size - h.data_start - h.data_bytes} trailing bytes of {n}")
        shards.append(sp)
    total = sum(s.data_bytes for s in shards)
    params = sum(map(prod, (t.shape for s in shards for t in s.specs)))
    index = N.index_name(chosen.stem, N.SAFETENSORS_EXT, variant=chosen.variant) if n_out > 1 else None
    return Plan(shards, index, total, params), [(str(root / n), headers[n].data_start, per_file[n]) for n in ordered]


def _drop_duplicates(root: Path, headers: dict[str, Header], per_file: dict[str, list[TensorInfo]],
                     rep: Repair) -> None:
    """Fill ``per_file`` when a tensor is stored in more than one file: the first file (in name
    order) keeps it, a later copy with identical bytes is dropped (``rep.duplicates``), a copy
    that differs is refused."""
    seen: dict[str, tuple[str, str]] = {}  # tensor -> (file, digest)
    for n in sorted(headers):
        h = headers[n]
        keep = []
        for t in h.tensors.values():
            if t.name in seen:
                first_file, digest = seen[t.name]
                first = headers[first_file].tensors[t.name]
                mine = _hash_range(root / n, h.data_start + t.begin, t.nbytes)
                if digest is None:
                    digest = _hash_range(root / first_file, headers[first_file].data_start + first.begin, first.nbytes)
                    seen[t.name] = (first_file, digest)
                if (first.dtype, first.shape) != (t.dtype, t.shape) or digest != mine:
                    raise UnrepairableError(f"{root}: tensor {t.name!r} is stored in {first_file} and {n} with "
                                            "different contents", "cannot tell which is right; nothing was changed")
                rep.duplicates[t.name] = n
                continue
            seen[t.name] = (n, None)  # type: ignore[assignment]
            keep.append(t)
        if keep:
            per_file[n] = keep


def keep_layout_source(root: Path, kept: Kept) -> tuple[Source, list[Entry]]:
    """The source of a keep-layout plan's tensors, each read at its offset in the file it is kept from."""
    src = SafetensorsSource(path=root, kind="safetensors")
    for path, data_start, tensors in kept:
        src.tensors.extend(SourceTensor(t.spec, file=path, offset=data_start + t.begin) for t in tensors)
    return src, entries_for(src, None)


def link_matching(plan: Plan, root: Path, entries: list[Entry]) -> None:
    """Mark planned shards whose bytes are exactly an existing file of ``root``: same name, same
    header bytes, and every tensor read from that very file at the same offset, unconverted."""
    by_name = {e.tensor.name: e for e in entries}
    for sp in plan.shards:
        existing = root / sp.name
        if not existing.is_file() or existing.stat().st_size != sp.file_size:
            continue
        base = len(sp.header)
        if not all(by_name[t.name].tensor.file == str(existing) and by_name[t.name].tensor.offset == base + t.begin
                   and by_name[t.name].dtype == by_name[t.name].tensor.dtype for t in sp.layout):
            continue
        with open(existing, "rb") as f:
            if f.read(base) != sp.header:
                continue
        sp.link_from = str(existing)



def already_so(root: Path, chosen: Chosen, plan: Plan, rep: Repair, *,
               weight_map: dict[str, str] | None = None) -> bool:
    """The keep-layout plan is the directory as it is: nothing to fix, every shard an unchanged
    file under its own name, the index (as its library wrote it) mapping every tensor to the
    shard that holds it with the right total size, and nothing the new version would drop.
    ``weight_map``: the plan's, when the caller has it."""
    from ckptctl.write.superseded import superseded

    if rep.fixes or any(sp.link_from != str(root / sp.name) for sp in plan.shards):
        return False
    if plan.index_name != chosen.index_file:
        return False
    if plan.index_name is not None:
        old = chosen.index
        if old is None or old.metadata.get("total_size") != plan.total_size or old.weight_map != (
                plan.weight_map if weight_map is None else weight_map):
            return False
    dropped, _ = superseded(root, slot=L.slot_of(chosen.stem, chosen.variant), lay=chosen.layout)
    return set(dropped) <= set(plan.files) | {MANIFEST_NAME}


def note_index_changes(old: Index, plan: Plan, rep: Repair, *, weight_map: dict[str, str] | None = None) -> None:
    """Say what the rebuilt index corrects in the old (readable) one. ``weight_map``: the
    plan's, when the caller has it."""
    new_map = plan.weight_map if weight_map is None else weight_map
    if old.metadata.get("total_size") != plan.total_size:
        rep.fixes.append(f"index total_size {old.metadata.get('total_size')!r} -> {plan.total_size}")
    if old.weight_map == new_map:
        return  # the same entries: nothing missing, stale or moved
    missing = sorted(set(new_map) - set(old.weight_map))
    if missing:
        rep.fixes.append(f"added {len(missing)} tensor(s) missing from the index (e.g. {missing[0]})")
    stale = sorted(set(old.weight_map) - set(new_map))
    if stale:
        rep.lost = stale
        rep.fixes.append(f"dropped {len(stale)} index entr(ies) for tensors no shard holds (e.g. {stale[0]})")
    moved = sorted(k for k in set(new_map) & set(old.weight_map) if old.weight_map[k] != new_map[k])
    if moved:
        rep.fixes.append(f"remapped {len(moved)} tensor(s) to the shard that holds them (e.g. {moved[0]})")


def own_metadata(old: Index) -> dict[str, str]:
    """The previous index's own metadata (alias records, user keys), without the computed sizes."""
    return {k: v for k, v in old.metadata.items() if k not in ("total_size", "total_parameters") and isinstance(v, str)}
