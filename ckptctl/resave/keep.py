"""Keep-layout resave: every shard of the kept family stays as it is (hard-linked, renamed when
its ``-of-N`` name was wrong); only a shard that must change (a tensor stored twice, trailing
bytes) is rewritten, by kernel copy; the index is rebuilt from the headers. And the test that
the plan is the directory as it already is (a repair with nothing to do)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ckptctl import layout as L
from ckptctl.errors import UnrepairableError, from_oserror
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.format.names import MANIFEST_NAME
from ckptctl.format.header import Header, TensorInfo, TensorTable, encode_header
from ckptctl.format.index import Index
from ckptctl.layout.reading import MetadataReading
from ckptctl.resave.analyze import Chosen, Repair

if TYPE_CHECKING:
    from ckptctl.plan import Plan
    from ckptctl.sources.base import Source
    from ckptctl.write.inputs import Entry


def _open(path: Path) -> int:
    """A shard opened for reading: ``O_NONBLOCK``, a regular file (checked before the open and on
    the descriptor), links followed as the header reader follows them (a cache snapshot's shards
    are links into ``blobs/``). A file that is gone or unreadable is an error of one line (exit 3),
    never a traceback."""
    try:
        return small.open_small(path, follow=True)
    except OSError as exc:
        raise from_oserror(exc, f"cannot read {path}", phase="read-source") from None


def _chunks(path: Path, offset: int, length: int) -> Iterator[bytes]:
    """``length`` bytes of ``path`` at ``offset`` (fewer at its end), in pieces of at most 8 MiB;
    an error reading is one line (exit 3)."""
    fd = _open(path)
    try:
        done = 0
        while done < length:
            chunk = os.pread(fd, min(length - done, 8 << 20), offset + done)
            if not chunk:
                return
            yield chunk
            done += len(chunk)
    except OSError as exc:
        raise from_oserror(exc, f"cannot read {path}", phase="read-source") from None
    finally:
        os.close(fd)


def _pread(path: Path, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` at ``offset`` (fewer at its end)."""
    return b"".join(_chunks(path, offset, length))


def _hash_range(path: Path, offset: int, length: int) -> str:
    import hashlib

    h = hashlib.sha256()
    for chunk in _chunks(path, offset, length):
        h.update(chunk)
    return h.hexdigest()


# The tensors a keep-layout plan reads, file by file: (path, data start, the file's kept entries).
Kept = list[tuple[str, int, list[TensorInfo]]]


@dataclass
class KeptFiles:
    """A keep-layout plan decided file by file, before a record of any tensor is made (a repair
    with nothing to do makes none): the files that keep tensors (name order), each one's name in
    the new version, what it keeps (its whole table, or the records left once a tensor stored
    twice is dropped) and whether it stays byte for byte as it is (then it is hard-linked)."""

    root: Path
    headers: dict[str, Header]
    files: list[str]
    names: list[str]
    keeps: list[TensorTable | list[TensorInfo]]
    unchanged: list[bool]
    index_name: str | None
    # the index the files came with, and whether it maps to each of them, under its own name,
    # exactly the names its header holds (kept_files asked it: no tensor is then stored twice)
    agreed: tuple[Index, bool] | None = None

    @property
    def total_size(self) -> int:
        """The plan's tensor bytes: a file kept as it is ends where its last tensor ends, a
        rewritten one holds its tensors back to back (``encode_header``'s layout)."""
        return sum(self.headers[n].tensors.data_end if same else sum(t.spec.nbytes for t in _records(keep))
                   for n, keep, same in zip(self.files, self.keeps, self.unchanged))

    @cached_property
    def weight_map(self) -> dict[str, str]:
        """The plan's ``weight_map`` (each kept tensor to its file's new name, in plan order), from
        the headers' names (made once, when asked for)."""
        out: dict[str, str] = {}
        for keep, name in zip(self.keeps, self.names):
            out.update(zip(keep if isinstance(keep, TensorTable) else (t.name for t in keep), repeat(name)))
        return out

    def same_map_as(self, old: Index) -> bool:
        """Whether ``old`` maps exactly the plan's tensors to the plan's files (``weight_map``
        equality), said with C loops and without making the plan's map: every kept tensor is
        mapped to its file's new name, and ``old`` has no other entry (:func:`kept_files` keeps
        each tensor in one file only)."""
        whole = [keep is self.headers[n].tensors for n, keep in zip(self.files, self.keeps)]
        if self.agreed is not None and self.agreed[0] is old and self.names == self.files and all(whole):
            return self.agreed[1]  # the plan is the files as they are: asked already
        held = {name: keep if isinstance(keep, TensorTable) else [t.name for t in keep]
                for keep, name in zip(self.keeps, self.names)}
        return old.agrees(held, whole=True)


def _records(keep: TensorTable | list[TensorInfo]) -> list[TensorInfo]:
    return list(keep.values()) if isinstance(keep, TensorTable) else keep


def kept_files(root: Path, chosen: Chosen, rep: Repair) -> KeptFiles:
    """What a keep-layout plan does with each file: each file keeps its tensors together under
    its library's name and variant; a file that does not change is linked. The fixes it implies
    (a tensor stored twice, a renamed file, trailing bytes dropped) are added to ``rep``."""
    files = chosen.files
    reading = chosen.layout.reading if chosen.layout is not None else MetadataReading()
    headers = {n: chosen.headers.get(n) or reading.header(root / n, display=str(root / n)) for n in files}
    keeps: dict[str, TensorTable | list[TensorInfo]]
    # no tensor stored twice: the index says so where it maps to each file exactly its header's
    # names (it names each tensor once), else the distinct names are counted
    tables = {n: headers[n].tensors for n in sorted(files) if headers[n].tensors}
    agreed = (chosen.index, chosen.index.agrees(tables, whole=True)) if chosen.index is not None else None
    if (agreed is not None and agreed[1]) or len(set().union(*tables.values())) == sum(map(len, tables.values())):
        # no tensor stored twice: every file keeps all its tensors
        keeps = dict(tables)
    else:
        per_file: dict[str, list[TensorInfo]] = {}
        _drop_duplicates(root, headers, per_file, rep)
        keeps = dict(per_file)
    if rep.duplicates:
        rep.fixes.append(f"kept {len(rep.duplicates)} tensor(s) stored twice with identical bytes once")
    ordered = sorted(keeps)
    n_out = len(ordered)
    names, unchanged = [], []
    for i, n in enumerate(ordered, start=1):
        new_name = N.weights_file_name(chosen.stem, N.SAFETENSORS_EXT, variant=chosen.variant,
                                       shard=(i, n_out) if n_out > 1 else None)
        h = headers[n]
        whole = h.data_start + h.data_bytes == h.file_size
        same = len(keeps[n]) == len(h.tensors) and whole
        if same and new_name != n:
            rep.fixes.append(f"renamed {n} to {new_name} (content unchanged)")
        elif not whole:
            rep.fixes.append(f"dropped {h.file_size - h.data_start - h.data_bytes} trailing bytes of {n}")
        names.append(new_name)
        unchanged.append(same)
    index = N.index_name(chosen.stem, N.SAFETENSORS_EXT, variant=chosen.variant) if n_out > 1 else None
    return KeptFiles(root, headers, ordered, names, [keeps[n] for n in ordered], unchanged, index, agreed)


def keep_layout_plan(kf: KeptFiles) -> tuple[Plan, Kept]:
    """The plan of :func:`kept_files`' decisions (a record per tensor), with what each file
    contributes (:func:`keep_layout_source` makes the source of it)."""
    from ckptctl.plan import Plan, ShardPlan  # the writer's, imported only once something is written

    shards: list[ShardPlan] = []
    kept: Kept = []
    for n, new_name, keep, same in zip(kf.files, kf.names, kf.keeps, kf.unchanged):
        h = kf.headers[n]
        infos = _records(keep)
        specs = [t.spec for t in infos]
        if same:
            raw_header = _pread(kf.root / n, 0, h.data_start)
            shards.append(ShardPlan(new_name, specs, h.metadata, raw_header, list(infos), link_from=str(kf.root / n)))
        else:
            md = h.metadata if h.metadata is not None else {"format": "pt"}
            header, lay = encode_header(specs, md)
            shards.append(ShardPlan(new_name, specs, md, header, lay))
        kept.append((str(kf.root / n), h.data_start, infos))
    params = sum(map(prod, (t.shape for s in shards for t in s.specs)))
    return Plan(shards, kf.index_name, kf.total_size, params), kept


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
    from ckptctl.sources.base import SourceTensor
    from ckptctl.sources.safetensors_source import SafetensorsSource
    from ckptctl.write.inputs import entries_for

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
        try:
            st = os.stat(existing)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != sp.file_size:
            continue
        base = len(sp.header)
        if not all(by_name[t.name].tensor.file == str(existing) and by_name[t.name].tensor.offset == base + t.begin
                   and by_name[t.name].dtype == by_name[t.name].tensor.dtype for t in sp.layout):
            continue
        if _pread(existing, 0, base) != sp.header:
            continue
        sp.link_from = str(existing)



def already_so(root: Path, chosen: Chosen, kf: KeptFiles, rep: Repair, *, same_map: bool | None = None) -> bool:
    """The keep-layout plan is the directory as it is: nothing to fix, every shard an unchanged
    file under its own name, the index (as its library wrote it) mapping every tensor to the
    shard that holds it with the right total size, and nothing the new version would drop.
    ``same_map``: :meth:`KeptFiles.same_map_as` of the old index, when the caller has it."""
    from ckptctl.write.superseded import superseded

    if rep.fixes or not all(kf.unchanged) or kf.names != kf.files:
        return False
    if kf.index_name != chosen.index_file:
        return False
    if kf.index_name is not None:
        old = chosen.index
        if old is None or old.metadata.get("total_size") != kf.total_size or not (
                kf.same_map_as(old) if same_map is None else same_map):
            return False
    dropped, _ = superseded(root, slot=L.slot_of(chosen.stem, chosen.variant), lay=chosen.layout)
    # a pickle family holding the same tensors (layout.converted_pickle) is part of a sound layout
    twins = {n for f in chosen.layout.families if f.twin_of for n in f.all_files} if chosen.layout else set()
    return set(dropped) - twins <= set(kf.names) | {kf.index_name} - {None} | {MANIFEST_NAME}


def note_index_changes(old: Index, kf: KeptFiles, rep: Repair, *, same_map: bool | None = None) -> None:
    """Say what the rebuilt index corrects in the old (readable) one. ``same_map``:
    :meth:`KeptFiles.same_map_as` of ``old``, when the caller has it."""
    total = kf.total_size
    if old.metadata.get("total_size") != total:
        rep.fixes.append(f"index total_size {old.metadata.get('total_size')!r} -> {total}")
    if kf.same_map_as(old) if same_map is None else same_map:
        return  # the same entries: nothing missing, stale or moved
    new_map = kf.weight_map
    old_map = old.shared_map
    missing = sorted(set(new_map) - set(old_map))
    if missing:
        rep.fixes.append(f"added {len(missing)} tensor(s) missing from the index (e.g. {missing[0]})")
    stale = sorted(set(old_map) - set(new_map))
    if stale:
        rep.lost = stale
        rep.fixes.append(f"dropped {len(stale)} index entr(ies) for tensors no shard holds (e.g. {stale[0]})")
    moved = sorted(k for k in set(new_map) & set(old_map) if old_map[k] != new_map[k])
    if moved:
        rep.fixes.append(f"remapped {len(moved)} tensor(s) to the shard that holds them (e.g. {moved[0]})")


def own_metadata(old: Index) -> dict[str, str]:
    """The previous index's own metadata (alias records, user keys), without the computed sizes."""
    return {k: v for k, v in old.metadata.items() if k not in ("total_size", "total_parameters") and isinstance(v, str)}
