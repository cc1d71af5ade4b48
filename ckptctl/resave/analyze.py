"""What a resave keeps: the one family of the model's slot, chosen among the saves the directory
holds (``saves.split``) by the one ranking policy (``layout.choose``), and every fix that choice
implies. What is certain is done; two complete saves ask for ``--prefer``; a save that cannot be
made whole is refused with what is lost."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ckptctl import layout as L
from ckptctl.errors import InputError, UnrepairableError, UsageError
from ckptctl.findings import ERROR, Finding
from ckptctl.format import names as N
from ckptctl.format.header import Header
from ckptctl.format.index import Index
from ckptctl.layout.policy import label
from ckptctl.layout.reading import MetadataReading
from ckptctl.resave.saves import Save, assess, is_complete, mtime_ns, read_all, split, usable_index


@dataclass
class Repair:
    """What the analysis decided: the files kept (by role), what is dropped, and why."""

    kept_files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    duplicates: dict[str, str] = field(default_factory=dict)  # tensor -> file whose copy is dropped
    lost: list[str] = field(default_factory=list)  # tensors the old index names that no kept file holds


@dataclass
class Chosen:
    """The safetensors files a resave keeps, and the index they came with (parsed once by layout)."""

    files: list[str]
    index: Index | None = None
    stem: str = "model"  # the library name the files keep (diffusion_pytorch_model, ...)
    variant: str | None = None
    index_file: str | None = None  # the index file as it is on disk
    errors: list[Finding] = field(default_factory=list)  # the layout's error findings
    headers: dict[str, Header] = field(default_factory=dict)  # the headers the choice read (not read twice)
    layout: L.Layout | None = None  # the scan the choice was made on (the directory unchanged since)


def _twins_by_bytes(root: Path, lay: L.Layout) -> None:
    """A repair judges a pickle family with the safetensors family's names, dtypes and shapes
    (``layout.converted_pickle``) by its bytes too (what ``verify --deep`` does): with other
    bytes it is a second model, and keeping one is the user's call (``--prefer``)."""
    if not any(f.twin_of for f in lay.families):
        return
    from ckptctl.verify.consistency_twins import twin_differences

    try:
        differ, _ = twin_differences(root, lay)
    except OSError:
        differ = {"?": []}
    if differ:
        raise UsageError(f"{root} holds both safetensors and pytorch_model*.bin weights: the same names, dtypes and "
                         f"shapes, other bytes ({', '.join(sorted(differ))})",
                         "choose with --prefer safetensors or --prefer pytorch")


def _model_families(lay: L.Layout, prefer: str | None = None) -> list[L.Family]:
    """The model families a repair chooses among: a pickle family holding the same tensors as the
    safetensors one (``layout.converted_pickle``) only when ``--prefer`` names a container."""
    twins = prefer in (L.SAFETENSORS, L.PYTORCH)
    return [f for f in L.candidates(lay, twins=twins) if f.kind in (L.SAFETENSORS, L.PYTORCH)]


def analyze(root: Path, *, prefer: str | None = None, repair: bool = False,
            lay: L.Layout | None = None, reading: MetadataReading | None = None) -> tuple[Chosen, Repair]:
    """Choose the safetensors files that make up the checkpoint (none: a pickle checkpoint that is
    converted like an export), from ``layout.scan`` and its one ranking policy. ``lay``: the scan
    of ``root`` as it is now, when the caller has it; else it is scanned with ``reading``."""
    if lay is None:
        lay = L.scan(root, reading=reading)
    rep = Repair()
    errors = [f for f in lay.findings if f.severity == ERROR]
    if not repair and (errors or lay.leftovers):
        first = (errors or [Finding("layout.leftover", ERROR, str(root), f"leftovers: {', '.join(lay.leftovers)}")])[0]
        raise UsageError(f"{root} needs repair: {first.message}",
                         f"run `ckptctl resave --repair {root}` (add --dry-run to see the plan)")

    fams = _model_families(lay, prefer)
    if repair and prefer is None:
        _twins_by_bytes(root, lay)
    _refuse_other_kinds(root, lay, fams)
    containers = {f.container for f in fams}
    if containers == {L.SAFETENSORS, L.PYTORCH}:
        if prefer not in (L.SAFETENSORS, L.PYTORCH):
            raise UsageError(f"{root} holds both safetensors and pytorch_model*.bin weights",
                             "choose with --prefer safetensors or --prefer pytorch")
        if prefer == L.PYTORCH:
            rep.fixes.append("kept the pytorch weights (--prefer pytorch), converted to safetensors")
            return Chosen([]), rep
        rep.fixes.append("dropped the pytorch_model*.bin family (--prefer safetensors)")
        fams = [f for f in fams if f.container == L.SAFETENSORS]
        prefer = None
    elif containers == {L.PYTORCH}:
        return Chosen([], errors=errors), rep  # pickles only: converted like an export
    if not fams:
        raise InputError(f"{root} holds no model safetensors weights to resave",
                         f"run `ckptctl inspect {root}` to see what it holds")
    chosen, headers = _choose_save(root, lay, fams, prefer, rep)
    # stray weights outside the naming scheme that a glob-loader would pick up; never a named
    # family of another slot (a variant, a diffusers or PEFT family beside the model)
    unref = [n for n in sorted(os.listdir(root)) if N.is_safetensors(n) and n not in chosen.files
             and n not in lay.leftovers and n not in lay.native and _stray_or_same_slot(n, chosen)
             and n not in rep.dropped]
    if unref:
        rep.fixes.append("removed weights not part of the checkpoint: " + ", ".join(unref))
        rep.dropped.extend(unref)
    if lay.leftovers:
        rep.fixes.append("removed leftovers: " + ", ".join(lay.leftovers))
    rep.kept_files = list(chosen.files)
    doc = chosen.index_doc if chosen.index_doc is not None and chosen.index_doc.ok else None
    return Chosen(list(chosen.files), doc, L.safetensors_stem(chosen.stem) or "model", chosen.variant,
                  chosen.index, errors, headers, lay), rep


def _choose_save(root: Path, lay: L.Layout, fams: list[L.Family], prefer: str | None,
                 rep: Repair) -> tuple[L.Family, dict[str, Header]]:
    """The save the repair keeps, among every save of the slot, with the headers of its files;
    refused (nothing changed) when it is not complete."""
    from ckptctl.config_fields import read_config

    cfg = read_config(root)
    names = sorted(os.listdir(root))
    saves = [s for f in fams for s in split(root, f, names)]
    empty = [s for s in saves if not s.family.files]
    if empty and len(empty) < len(saves):  # an index none of whose shards exist, beside real weights
        for s in empty:
            rep.fixes.append(f"dropped the stale index {s.family.index} (none of its shards exist)")
            rep.dropped.append(str(s.family.index))
        saves = [s for s in saves if s.family.files]
    by_family = {id(s.family): s for s in saves}
    judged: dict[int, L.Assessment] = {}
    read: dict[int, tuple[dict[str, Header], list[Finding]]] = {}  # each save's headers, read once

    def headers_of(fam: L.Family) -> tuple[dict[str, Header], list[Finding]]:
        got = read.get(id(fam))
        if got is None:
            got = read[id(fam)] = read_all(root, fam.files, lay.reading)
        return got

    def judge(fam: L.Family) -> L.Assessment:
        if id(fam) not in judged:
            judged[id(fam)] = assess(root, by_family[id(fam)], cfg, headers_of(fam))
        return judged[id(fam)]

    # saves are judged (config.json, tensor counts) only where the choice among them or a fix's
    # message needs it: a lone save is kept whatever config.json says (the final verify judges it)
    chosen = L.choose(lay, prefer=prefer, assess=judge, among=[s.family for s in saves])
    save = by_family[id(chosen)]
    problems = headers_of(chosen)[1]
    # Shards numbered -of-N with numbers missing and no index: when it is the only save, nothing
    # says the missing numbers ever existed (a writer that misnamed its shards); they are
    # renumbered, and the final verify judges the result.
    renumber = save.gaps_only and len(saves) == 1 and not problems
    if not is_complete(save, problems) and not renumber:
        raise _incomplete(root, save, lay.reading)
    _refuse_a_mix(root, lay, chosen)
    why = f"--prefer {prefer}" if prefer else None
    for s in saves:
        if s.family is chosen:
            continue
        other = judge(s.family)
        reason = why or ("incomplete" if not other.complete else "disagrees with config.json")
        rep.fixes.append(f"kept {label(chosen)} ({chosen.describe()}, {judge(chosen).tensors} tensors); dropped "
                         f"{', '.join(s.family.all_files)} ({reason})")
        rep.dropped.extend(n for n in s.family.all_files if n not in chosen.all_files)
    broken = [f.index for f in fams if f.index and not usable_index(f)]
    if broken:
        rep.fixes.append(f"replaced the unreadable index {broken[0]} (rebuilt from the headers of the shards kept)")
    elif chosen.index is None and len(chosen.files) > 1:
        rep.fixes.append(f"wrote an index for {', '.join(chosen.files)} from their headers")
    return chosen, read[id(chosen)][0]


def _refuse_a_mix(root: Path, lay: L.Layout, chosen: L.Family) -> None:
    """An in-place streaming writer (temp shards ``-of-?????``, then renamed to the final names)
    that died while renaming leaves a family that looks complete but mixes two saves: the shards
    it renamed are newer than the index, the others are not. Which save is right is not there to
    know: refused."""
    if chosen.index is None:
        return
    prefix = f"{chosen.stem}.{chosen.variant}-" if chosen.variant else f"{chosen.stem}-"
    temps = [n for n in lay.leftovers if n.startswith(prefix) and N.leftover_kind(n, is_dir=False) == "temp-shards"]
    if not temps:
        return
    written = mtime_ns(root / chosen.index)
    newer = [n for n in chosen.files if mtime_ns(root / n) > written]
    if 0 < len(newer) < len(chosen.files):
        raise UnrepairableError(
            f"{root}: {chosen.index} and its shards mix two saves: {', '.join(newer)} were written after the index "
            f"by the writer whose temp shards remain ({', '.join(temps)}), the other shards are the earlier save's",
            "neither save is whole here: restore the checkpoint from a copy or run the interrupted save again; "
            "nothing was changed")


def _incomplete(root: Path, save: Save, reading: MetadataReading) -> UnrepairableError:
    """The refusal for a save that cannot be made whole: what is missing and which tensors are lost."""
    headers, problems = read_all(root, save.family.files, reading)
    doc = save.family.index_doc
    lost: list[str] = []
    if doc is not None and doc.ok:
        lost = sorted(k for k, v in doc.shared_map.items() if v not in headers)
    what = [f"missing {', '.join(save.missing)}"] if save.missing else []
    what += [] if save.family.files else ["none of its weights files exists"]
    what += [p.message for p in problems[:3]]
    return UnrepairableError(
        f"{root}: {label(save.family)} cannot be made whole: " + "; ".join(what)
        + (f"; {len(lost)} tensors are lost (e.g. {', '.join(lost[:3])})" if lost else ""),
        "the data is not there: restore the damaged or missing files from a copy; nothing was changed")


def _stray_or_same_slot(name: str, chosen: L.Family) -> bool:
    """A file the new version drops: one of the chosen slot's own names, or (for the main model)
    a file outside every library's naming scheme."""
    named = L.named_slot(name)
    return chosen.slot == ("model", None) if named is None else named == chosen.slot


def _refuse_other_kinds(root: Path, lay: L.Layout, fams: list[L.Family]) -> None:
    """resave rewrites model weights in place; what it does not rewrite is refused with the
    command that does: a PEFT adapter or a DCP directory is exported, a multi-component root is
    resaved component by component."""
    if fams:
        return
    if lay.kind != L.MODEL:
        with_weights = [c.path for c in lay.components if c.has_weights and c.path]
        raise UsageError(f"{root} is a {lay.kind} root: resave rewrites one model's weights at a time",
                         "resave each component folder that holds weights"
                         + (f" ({', '.join(with_weights)})" if with_weights else ""))
    kinds = {f.kind for f in lay.families}
    if L.PEFT in kinds:
        raise UsageError(f"{root} holds a PEFT adapter: resave rewrites model weights only",
                         f"use `ckptctl export {root} OUT` to rewrite the adapter as adapter_model.safetensors")
    if L.DCP in kinds or L.DCP_HF in kinds:
        raise UsageError(f"{root} is a torch DCP checkpoint: resave rewrites safetensors checkpoints in place",
                         f"use `ckptctl export {root} OUT` (with --key for a training state) to convert it")
