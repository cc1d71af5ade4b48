"""``resave``: re-shard, re-type or repair a checkpoint in place, through the publish protocol.

Two ways to build the new version:

- **keep layout** (``--repair`` without ``--max-shard-size``/``--dtype``): every shard of the
  family that is kept stays as it is and is hard-linked into the staging directory, renamed when
  its ``-of-N`` name was wrong; only a shard that must change (a tensor stored twice, trailing
  bytes) is rewritten, by kernel copy. The index is rebuilt from the shard headers. A repair that
  only fixes the index or removes stale files writes no tensor data at all.
- **re-plan** (``--max-shard-size`` or ``--dtype``): a new plan; a planned shard whose bytes
  already exist in a file of the directory is hard-linked, other bytes are copied by the kernel,
  converted tensors stream through Python in bounded chunks.

What cannot be repaired without data that is not there (a truncated or missing shard, a corrupt
header, a tensor stored twice with different bytes) is refused with exit 1 and a list of what is
lost; nothing is changed.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptctl import layout as L
from ckptctl.config_fields import ConfigFields, as_int
from ckptctl.errors import InputError, UnrepairableError, UsageError
from ckptctl.findings import ERROR, Finding
from ckptctl.format import dtypes as dt
from ckptctl.format.header import Header, TensorInfo, encode_header, read_header
from ckptctl.format import names as N
from ckptctl.format.index import Index
from ckptctl.manifest import MANIFEST_NAME
from ckptctl.plan import Plan, ShardPlan
from ckptctl.sources.base import Source, SourceTensor
from ckptctl.sources.safetensors_source import SafetensorsSource
from ckptctl.write.inputs import Entry, build_inputs, entries_for
from ckptctl.write.job import ExportResult, write_inputs
from ckptctl.write.options import ExportOptions, ExportSettings, validate

@dataclass
class Repair:
    """What the analysis decided: the files kept (by role), what is dropped, and why."""

    kept_files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    duplicates: dict[str, str] = field(default_factory=dict)  # tensor -> file whose copy is dropped


@dataclass
class ResaveResult:
    export: ExportResult
    repair: Repair
    unchanged: bool = False  # --repair of a healthy checkpoint: nothing written, nothing published

    def to_dict(self) -> dict[str, Any]:
        doc = self.export.to_dict()
        doc["fixes"] = self.repair.fixes
        doc["unchanged"] = self.unchanged
        doc["dropped"] = self.repair.dropped
        return doc


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


def _config_mismatches(tensors: dict[str, TensorInfo], cfg: dict[str, Any] | None) -> int:
    """How many of config.json's basic facts a tensor set contradicts (0 = consistent)."""
    if not cfg:
        return 0
    bad = 0
    fields = ConfigFields(cfg)
    vocab = as_int(fields.get("vocab_size"))
    layers = as_int(fields.get("num_hidden_layers"))
    for name, t in tensors.items():
        if vocab and name.endswith(("embed_tokens.weight", "wte.weight", "lm_head.weight")) and t.shape:
            bad += t.shape[0] != vocab
    if isinstance(layers, int):
        idx = {int(m.group(1)) for n in tensors for m in [re.search(r"\.(?:layers|h|blocks)\.(\d+)\.", n)] if m}
        if idx and (len(idx) != layers or min(idx) != 0 or max(idx) != layers - 1):  # never range(layers)
            bad += 1
    return bad


def _read_all(root: Path, names: list[str]) -> tuple[dict[str, Header], list[Finding]]:
    headers, problems = {}, []
    for n in names:
        p = root / n
        if not p.is_file():
            problems.append(Finding("index.shard_missing", ERROR, str(p), f"{n} is missing"))
            continue
        h = read_header(p, display=str(p))
        fatal = [f for f in h.findings if f.severity == ERROR and f.code != "header.trailing_bytes"]
        if fatal:
            problems.extend(fatal)
        headers[n] = h
    return headers, problems


@dataclass
class _Chosen:
    """The safetensors files a resave keeps, and the index they came with (parsed once by layout)."""

    files: list[str]
    index: Index | None = None
    stem: str = "model"  # the library name the files keep (diffusion_pytorch_model, ...)
    variant: str | None = None
    index_file: str | None = None  # the index file as it is on disk
    errors: list[Finding] = field(default_factory=list)  # the layout's error findings


def _model_families(lay: L.Layout) -> list[L.Family]:
    return [f for f in L.candidates(lay) if f.kind in (L.SAFETENSORS, L.PYTORCH)]


def analyze(root: Path, *, prefer: str | None = None, repair: bool = False) -> tuple[_Chosen, Repair]:
    """Choose the safetensors files that make up the checkpoint (none: a pickle checkpoint that is
    converted like an export), from ``layout.scan`` and its one ranking policy."""
    lay = L.scan(root)
    rep = Repair()
    errors = [f for f in lay.findings if f.severity == ERROR]
    if not repair and (errors or lay.leftovers):
        first = (errors or [Finding("layout.leftover", ERROR, str(root), f"leftovers: {', '.join(lay.leftovers)}")])[0]
        raise UsageError(f"{root} needs repair: {first.message}",
                         f"run `ckptctl resave --repair {root}` (add --dry-run to see the plan)")

    fams = _model_families(lay)
    _refuse_other_kinds(root, lay, fams)
    containers = {f.container for f in fams}
    if containers == {L.SAFETENSORS, L.PYTORCH}:
        if prefer not in (L.SAFETENSORS, L.PYTORCH):
            raise UsageError(f"{root} holds both safetensors and pytorch_model*.bin weights",
                             "choose with --prefer safetensors or --prefer pytorch")
        if prefer == L.PYTORCH:
            rep.fixes.append("kept the pytorch weights (--prefer pytorch), converted to safetensors")
            return _Chosen([]), rep
        rep.fixes.append("dropped the pytorch_model*.bin family (--prefer safetensors)")
        fams = [f for f in fams if f.container == L.SAFETENSORS]
    elif containers == {L.PYTORCH}:
        return _Chosen([], errors=errors), rep  # pickles only: converted like an export
    if not fams:
        raise InputError(f"{root} holds no model safetensors weights to resave",
                         f"run `ckptctl inspect {root}` to see what it holds")

    sharded = next((f for f in fams if f.sharded), None)
    single = next((f for f in fams if not f.sharded), None)
    if sharded is not None:
        sharded = _usable_sharded(root, sharded, single, rep)
        fams = [f for f in (sharded, single) if f is not None]

    from ckptctl.inspect import read_config

    cfg = read_config(root)

    def assess(fam: L.Family) -> L.Assessment:
        headers, problems = _read_all(root, fam.files)
        tensors = {k: v for h in headers.values() for k, v in h.tensors.items()}
        return L.Assessment(complete=not problems, agrees=_config_mismatches(tensors, cfg) == 0)

    chosen = L.choose(lay, prefer=prefer if prefer in ("index", "single") else None, assess=assess, among=fams)
    if len(fams) > 1:
        dropped = next(f for f in fams if f is not chosen)
        rep.fixes.append(f"kept the {'sharded' if chosen.sharded else 'single-file'} weights, dropped "
                         + ", ".join(dropped.all_files))
    headers, problems = _read_all(root, chosen.files)
    if problems:
        raise UnrepairableError(
            f"{root}: {len(problems)} unrepairable problem(s): " + "; ".join(p.message for p in problems[:3]),
            "the data is not there: restore the damaged files from a copy; nothing was changed")
    # stray weights outside the naming scheme that a glob-loader would pick up; never a named
    # family of another slot (a variant, a diffusers or PEFT family beside the model)
    unref = [n for n in sorted(os.listdir(root)) if n.endswith(".safetensors") and n not in chosen.files
             and n not in lay.leftovers and _stray_or_same_slot(n, chosen)]
    if unref:
        rep.fixes.append("removed weights not part of the checkpoint: " + ", ".join(unref))
    if lay.leftovers:
        rep.fixes.append("removed leftovers: " + ", ".join(lay.leftovers))
    rep.kept_files = list(chosen.files)
    doc = chosen.index_doc if chosen.index_doc is not None and chosen.index_doc.ok else None
    return _Chosen(list(chosen.files), doc, L.safetensors_stem(chosen.stem) or "model", chosen.variant,
                   chosen.index, errors), rep


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
    if L.DCP in kinds:
        raise UsageError(f"{root} is a torch DCP checkpoint: resave rewrites safetensors checkpoints in place",
                         f"use `ckptctl export {root} OUT` (with --key for a training state) to convert it")


def _usable_sharded(root: Path, fam: L.Family, single: L.Family | None, rep: Repair) -> L.Family | None:
    """The sharded family as far as its index can be trusted: a stale index none of whose shards
    exist beside a single file is dropped; shards that are missing or that the index places
    outside the directory are a loss (refused); so are shards of several -of-N counts without a
    usable index."""
    doc = fam.index_doc
    if doc is not None and doc.ok and doc.weight_map:
        named = doc.shards
        missing = [s for s in named if s not in fam.files]
        if missing and single is not None and len(missing) == len(named):
            rep.fixes.append(f"dropped the stale index (none of its shards exist) beside {single.files[0]}")
            return None
        if missing:
            lost = sorted(k for k, v in doc.weight_map.items() if v in missing)
            raise UnrepairableError(
                f"{root}: {len(missing)} shard(s) named by the index are missing or outside the directory "
                f"({', '.join(missing)}); {len(lost)} tensors are lost (e.g. {', '.join(lost[:3])})",
                "restore the missing shards into the directory from a copy; nothing was changed")
        return fam
    if fam.index is not None:
        rep.fixes.append("rebuilt the unreadable index from the shard headers")
    counts = {w.shard[1] for n in fam.files for w in [N.parse_weights_name(n)] if w and w.shard}
    if len(counts) > 1:
        raise UnrepairableError(f"{root}: shard files of several -of-N families "
                                f"({', '.join(f'{c:05d}' for c in sorted(counts))}) and no usable index",
                                "keep the current family's shards and remove the rest by hand, then run resave "
                                "--repair again; nothing was changed")
    if not fam.files and single is not None:
        rep.fixes.append(f"dropped the stale index beside {single.files[0]}")
    return fam if fam.files else None


def _keep_layout_plan(root: Path, chosen: _Chosen, rep: Repair) -> tuple[Plan, Source, list[Entry]]:
    """A plan that keeps each file's tensors together, linking every file that does not change;
    the files keep their library's names and variant."""
    files = chosen.files
    src = SafetensorsSource(path=root, kind="safetensors")
    headers = {n: read_header(root / n, display=str(root / n)) for n in files}
    seen: dict[str, tuple[str, str]] = {}  # tensor -> (file, digest)
    per_file: dict[str, list[TensorInfo]] = {}
    for n in sorted(files):
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
            src.tensors.append(SourceTensor(t.spec, file=str(root / n), offset=h.data_start + t.begin))
        if keep:
            per_file[n] = keep
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
    params = sum(dt.numel(t.shape) for s in shards for t in s.specs)
    index = N.index_name(chosen.stem, N.SAFETENSORS_EXT, variant=chosen.variant) if n_out > 1 else None
    return Plan(shards, index, total, params), src, entries_for(src, None)


def _link_matching(plan: Plan, root: Path, entries: list[Entry]) -> None:
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


PREFER = ("index", "single", L.SAFETENSORS, L.PYTORCH)


def resave(root: str | os.PathLike[str], opts: ExportOptions, *, output: str | os.PathLike[str] | None = None,
           repair: bool = False, prefer: str | None = None, link: bool = False) -> ResaveResult:
    """Rewrite the checkpoint at ``root`` (in place, or into ``output``): re-plan when a shard
    size or dtype is given, else keep its layout and repair what is certain. ``link``: into
    ``output``, hard-link unchanged shards instead of cloning or copying them."""
    root = Path(root)
    # Every option is checked before anything touches the filesystem (a recovery renames).
    if prefer not in (None, *PREFER):
        raise UsageError(f"unknown --prefer {prefer!r}", f"use {', '.join(PREFER)}")
    # In place, unchanged shards are hard-linked (one name survives the publish); into --output
    # they are cloned or copied (an independent copy) unless the caller asked for links.
    opts = replace(opts, overwrite=True if not output else opts.overwrite, link_unchanged=not output or link)
    settings = validate(opts)
    if not opts.dry_run:  # a dead writer's half-done publish of this very directory comes first
        from ckptctl.staging import recover_destination

        recover_destination(Path(os.path.abspath(root)))
    if not root.is_dir():
        raise InputError(f"{root} is not a checkpoint directory", "resave works on a directory")
    chosen, rep = analyze(root, prefer=prefer, repair=repair)
    dest = Path(output) if output else root
    replan = opts.dtype not in (None, "keep") or (opts.max_shard_size is not None and not settings.keep_layout)
    extras: dict[str, Path | bytes] = {}
    if opts.dtype not in (None, "keep") and (root / "config.json").is_file():
        extras["config.json"] = root / "config.json"  # rewritten with the new dtype
    if output:
        for n in sorted(os.listdir(root)):
            if n in L.COPIED_EXTRAS and n not in extras:
                extras[n] = root / n
    if not chosen.files:  # pickles: read through torch like an export
        from ckptctl.sources.base import open_source

        with open_source(root, only=L.PYTORCH) as src:  # read (weights_only) even to find it sound
            if repair and not replan and not output and not rep.fixes:
                return _unchanged(dest, opts, rep, chosen.errors)  # a sound pickle checkpoint
            inputs = build_inputs(entries_for(src, opts.dtype), opts, settings, extras=extras, aliases=src.aliases,
                                  source=src)
            return ResaveResult(write_inputs(inputs, dest), rep)
    opts = replace(opts, prefix=chosen.stem, variant=chosen.variant)
    if replan:
        src = SafetensorsSource.open(root, chosen.files)
        entries = entries_for(src, opts.dtype)
        plan = _replan(entries, settings, src.metadata or None, opts)
        _link_matching(plan, root, entries)
        inputs = build_inputs(entries, opts, settings, extras=extras)
    else:
        plan, src, entries = _keep_layout_plan(root, chosen, rep)
        metadata = None
        if plan.index_name and chosen.index is not None:
            metadata = _own_metadata(chosen.index)
            _note_index_changes(chosen.index, plan, rep)
        inputs = build_inputs(entries, opts, settings, extras=extras, metadata=metadata)
        if repair and not output and _already_so(root, chosen, plan, rep):
            return _unchanged(dest, opts, rep, chosen.errors)
    return ResaveResult(write_inputs(inputs, dest, plan=plan), rep)


def _already_so(root: Path, chosen: _Chosen, plan: Plan, rep: Repair) -> bool:
    """The keep-layout plan is the directory as it is: nothing to fix, every shard an unchanged
    file under its own name, the index (as its library wrote it) mapping every tensor to the
    shard that holds it with the right total size, and nothing the new version would drop."""
    from ckptctl.write.superseded import superseded

    if rep.fixes or any(sp.link_from != str(root / sp.name) for sp in plan.shards):
        return False
    if plan.index_name != chosen.index_file:
        return False
    if plan.index_name is not None:
        old = chosen.index
        if old is None or old.weight_map != plan.weight_map or old.metadata.get("total_size") != plan.total_size:
            return False
    dropped, _ = superseded(root, slot=L.slot_of(chosen.stem, chosen.variant))
    return set(dropped) <= set(plan.files) | {MANIFEST_NAME}


def _unchanged(dest: Path, opts: ExportOptions, rep: Repair, errors: list[Finding] | None = None) -> ResaveResult:
    """The result of a repair that found nothing to do: no staging, no publish. When the layout
    still has an error finding, that is not "nothing to repair" (resave without --repair sent the
    user here): it is refused with the finding's own next step, never a loop back to --repair."""
    if errors:
        first = errors[0]
        hint = first.hint if first.hint and "resave --repair" not in first.hint else None
        raise UnrepairableError(f"{dest}: resave --repair has no certain fix for: {first.message}",
                                (hint or f"run `ckptctl verify {dest}` for the details") + "; nothing was changed")
    return ResaveResult(ExportResult(dest=str(Path(os.path.abspath(dest))), dry_run=opts.dry_run), rep, unchanged=True)


def _replan(entries: list[Entry], settings: ExportSettings, metadata: dict[str, str] | None,
            opts: ExportOptions) -> Plan:
    from ckptctl.plan import make_plan

    try:
        return make_plan([e.spec for e in entries], max_shard_size=settings.max_shard_size, metadata=metadata,
                         prefix=opts.prefix, variant=opts.variant)
    except ValueError as exc:
        raise InputError(str(exc), "check the tensor names and --max-shard-size") from None


def _note_index_changes(old: Index, plan: Plan, rep: Repair) -> None:
    """Say what the rebuilt index corrects in the old (readable) one."""
    new_map = plan.weight_map
    if old.metadata.get("total_size") != plan.total_size:
        rep.fixes.append(f"index total_size {old.metadata.get('total_size')!r} -> {plan.total_size}")
    missing = sorted(set(new_map) - set(old.weight_map))
    if missing:
        rep.fixes.append(f"added {len(missing)} tensor(s) missing from the index (e.g. {missing[0]})")
    stale = sorted(set(old.weight_map) - set(new_map))
    if stale:
        rep.fixes.append(f"dropped {len(stale)} index entr(ies) for tensors no shard holds (e.g. {stale[0]})")
    moved = sorted(k for k in set(new_map) & set(old.weight_map) if old.weight_map[k] != new_map[k])
    if moved:
        rep.fixes.append(f"remapped {len(moved)} tensor(s) to the shard that holds them (e.g. {moved[0]})")


def _own_metadata(old: Index) -> dict[str, str]:
    """The previous index's own metadata (alias records, user keys), without the computed sizes."""
    return {k: v for k, v in old.metadata.items() if k not in ("total_size", "total_parameters") and isinstance(v, str)}
