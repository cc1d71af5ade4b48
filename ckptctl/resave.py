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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptctl import layout as L
from ckptctl.errors import InputError, UnrepairableError, UsageError
from ckptctl.findings import ERROR, Finding
from ckptctl.format import dtypes as dt
from ckptctl.format.header import Header, TensorInfo, encode_header, read_header
from ckptctl.format.tensor import TensorSpec
from ckptctl.format.index import read_index
from ckptctl.plan import Plan, ShardPlan
from ckptctl.sources.base import Source, SourceTensor
from ckptctl.sources.safetensors_source import SafetensorsSource
from ckptctl.writer import Entry, ExportOptions, ExportResult, entries_for, write_checkpoint

SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


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

    def to_dict(self) -> dict[str, Any]:
        doc = self.export.to_dict()
        doc["fixes"] = self.repair.fixes
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
    vocab = cfg.get("vocab_size")
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
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


def analyze(root: Path, *, prefer: str | None = None, repair: bool = False) -> tuple[list[str], Repair]:
    """Choose the safetensors files that make up the checkpoint; returns (files, repair notes)."""
    lay = L.scan(root)
    rep = Repair()
    names = sorted(os.listdir(root))
    shard_files = [n for n in names if SHARD_RE.match(n)]
    single = "model.safetensors" if "model.safetensors" in names else None
    has_index = L.ST_INDEX in names
    pt_family = lay.family(L.PYTORCH)
    errors = [f for f in lay.findings if f.severity == ERROR]

    if not repair and (errors or lay.leftovers):
        first = (errors or [Finding("layout.leftover", ERROR, str(root), f"leftovers: {', '.join(lay.leftovers)}")])[0]
        raise UsageError(f"{root} needs repair: {first.message}",
                         f"run `ckptctl resave --repair {root}` (add --dry-run to see the plan)")

    # Which model family, when safetensors and pickles are both there
    if pt_family and (shard_files or single):
        if prefer not in ("safetensors", "pytorch"):
            raise UsageError(f"{root} holds both safetensors and pytorch_model*.bin weights",
                             "choose with --prefer safetensors or --prefer pytorch")
        if prefer == "pytorch":
            rep.fixes.append("kept the pytorch weights (--prefer pytorch), converted to safetensors")
            return [], rep
        rep.fixes.append("dropped the pytorch_model*.bin family (--prefer safetensors)")
    elif pt_family:
        return [], rep  # pickles only: converted like an export

    index_files: list[str] | None = None
    if has_index:
        idx = read_index(root / L.ST_INDEX)
        if idx.ok and idx.weight_map:
            bad = [s for s in idx.shards if "/" in s or "\\" in s or s.startswith(".")]
            if bad:
                rep.fixes.append(f"ignored index entries that point outside the directory: {', '.join(bad)}")
            index_files = [s for s in idx.shards if s not in bad]
            missing = [s for s in index_files if not (root / s).is_file()]
            if missing and single and len(missing) == len(index_files):
                rep.fixes.append("dropped the stale index (none of its shards exist) beside model.safetensors")
                index_files = None
                has_index = False
            elif missing:
                lost = sorted(k for k, v in idx.weight_map.items() if v in missing)
                raise UnrepairableError(
                    f"{root}: {len(missing)} shard(s) named by the index are missing ({', '.join(missing)}); "
                    f"{len(lost)} tensors are lost (e.g. {', '.join(lost[:3])})",
                    "restore the missing shards from a copy; nothing was changed")
        else:
            rep.fixes.append("rebuilt the unreadable index from the shard headers")

    # The sharded family: the index's shards, or (no usable index) the numbered shards on disk.
    if index_files is None and shard_files:
        counts = {SHARD_RE.match(n).group(2) for n in shard_files}
        if len(counts) > 1:
            raise UnrepairableError(f"{root}: shard files of several -of-N families ({', '.join(sorted(counts))}) "
                                    "and no usable index", "keep the current family's shards and remove the rest "
                                    "by hand, then run resave --repair again; nothing was changed")
        index_files = shard_files
    sharded = index_files or []

    from ckptctl.inspect import read_config

    cfg = read_config(root)

    chosen: list[str]
    if sharded and single:
        hs, ps = _read_all(root, sharded)
        h1, p1 = _read_all(root, [single])
        ok_sharded = not ps and _config_mismatches({k: v for h in hs.values() for k, v in h.tensors.items()}, cfg) == 0
        ok_single = not p1 and _config_mismatches(h1[single].tensors, cfg) == 0 if single in h1 else False
        if prefer in ("index", "single"):
            chosen = sharded if prefer == "index" else [single]
        elif ok_sharded and not ok_single:
            chosen = sharded
        elif ok_single and not ok_sharded:
            chosen = [single]
        elif ok_single and ok_sharded:
            raise UsageError(f"{root}: both model.safetensors and a sharded family with an index are complete",
                             "choose with --prefer index or --prefer single")
        else:
            raise UnrepairableError(f"{root}: neither model.safetensors nor the sharded family is complete and "
                                    "consistent with config.json", "restore one of them; nothing was changed")
        dropped_family = [single] if chosen == sharded else sharded + ([L.ST_INDEX] if has_index else [])
        rep.fixes.append(f"kept the {'sharded' if chosen == sharded else 'single-file'} weights, dropped "
                         + ", ".join(dropped_family))
    elif sharded:
        chosen = sharded
    elif single:
        chosen = [single]
        if has_index:
            rep.fixes.append("dropped the stale index beside model.safetensors")
    else:
        others = [n for n in names if n.endswith(".safetensors") and not n.startswith("adapter_model")
                  and not L.is_leftover(n)]
        if len(others) == 1:
            chosen = others
        else:
            raise InputError(f"{root} holds no model safetensors weights to resave",
                             f"run `ckptctl inspect {root}` to see what it holds")
    headers, problems = _read_all(root, chosen)
    if problems:
        raise UnrepairableError(
            f"{root}: {len(problems)} unrepairable problem(s): " + "; ".join(p.message for p in problems[:3]),
            "the data is not there: restore the damaged files from a copy; nothing was changed")
    unref = [n for n in names if n.endswith(".safetensors") and n not in chosen and not n.startswith("adapter_model")]
    if unref:
        rep.fixes.append("removed weights not part of the checkpoint: " + ", ".join(unref))
    if lay.leftovers:
        rep.fixes.append("removed leftovers: " + ", ".join(lay.leftovers))
    rep.kept_files = chosen
    return chosen, rep


def _keep_layout_plan(root: Path, files: list[str], rep: Repair, metadata: dict[str, str]
                      ) -> tuple[Plan, Source, list[Entry]]:
    """A plan that keeps each file's tensors together, linking every file that does not change."""
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
            src.tensors.append(SourceTensor(t.name, t.dtype, t.shape, file=str(root / n),
                                            offset=h.data_start + t.begin))
        if keep:
            per_file[n] = keep
    if rep.duplicates:
        rep.fixes.append(f"kept {len(rep.duplicates)} tensor(s) stored twice with identical bytes once")
    ordered = sorted(per_file)
    n_out = len(ordered)
    shards: list[ShardPlan] = []
    for i, n in enumerate(ordered, start=1):
        new_name = "model.safetensors" if n_out == 1 else f"model-{i:05d}-of-{n_out:05d}.safetensors"
        h = headers[n]
        keep = per_file[n]
        unchanged = (len(keep) == len(h.tensors) and h.data_start + h.data_bytes == h.file_size)
        specs = [TensorSpec(t.name, t.dtype, t.shape) for t in keep]
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
    index = "model.safetensors.index.json" if n_out > 1 else None
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


def resave(root: str | os.PathLike[str], opts: ExportOptions, *, output: str | os.PathLike[str] | None = None,
           repair: bool = False, prefer: str | None = None) -> ResaveResult:
    root = Path(root)
    if not opts.dry_run:  # a dead writer's half-done publish of this very directory comes first
        from ckptctl.publish import recover_destination

        recover_destination(Path(os.path.abspath(root)))
    if not root.is_dir():
        raise InputError(f"{root} is not a checkpoint directory", "resave works on a directory")
    if prefer not in (None, "index", "single", "safetensors", "pytorch"):
        raise UsageError(f"unknown --prefer {prefer!r}", "use index, single, safetensors or pytorch")
    files, rep = analyze(root, prefer=prefer, repair=repair)
    dest = Path(output) if output else root
    replan = opts.dtype not in (None, "keep") or opts.max_shard_size is not None
    extras: dict[str, Path | bytes] = {}
    if opts.dtype not in (None, "keep") and (root / "config.json").is_file():
        extras["config.json"] = root / "config.json"  # rewritten with the new dtype
    if output:
        for n in sorted(os.listdir(root)):
            if n in L.COPIED_EXTRAS and n not in extras:
                extras[n] = root / n
    overwrite = True if not output else opts.overwrite
    if not files:  # pickles: read through torch like an export
        from ckptctl.sources.base import open_source

        with open_source(root, only="pytorch") as src:
            o = _with(opts, overwrite)
            res = write_checkpoint(entries_for(src, opts.dtype), dest, o, extras=extras, aliases=src.aliases)
        return ResaveResult(res, rep)
    if replan:
        src = SafetensorsSource.open(root, files)
        o = _with(opts, overwrite, default_shard="5GB")
        from ckptctl.plan import make_plan
        from ckptctl.sizes import parse_size

        entries = entries_for(src, o.dtype)
        try:
            plan = make_plan([e.spec for e in entries], max_shard_size=parse_size(o.max_shard_size),
                             metadata=src.metadata or None)
        except ValueError as exc:
            raise UsageError(str(exc), "use a size like 5GB, 500MB or 2GiB") from None
        _link_matching(plan, root, entries)
        res = write_checkpoint(entries, dest, o, extras=extras, plan=plan)
    else:
        plan, src, entries = _keep_layout_plan(root, files, rep, {})
        o = _with(opts, overwrite, default_shard="5GB")
        if plan.index_name:
            o.metadata = {**_old_index_metadata(root), **(o.metadata or {})}
        _note_index_changes(root, plan, rep)
        res = write_checkpoint(entries, dest, o, extras=extras, plan=plan)
    return ResaveResult(res, rep)


def _note_index_changes(root: Path, plan: Plan, rep: Repair) -> None:
    """Say what the rebuilt index corrects in the old one (when the old one was readable)."""
    p = root / L.ST_INDEX
    if not plan.index_name or not p.is_file():
        return
    old = read_index(p)
    if not old.ok:
        return
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


def _old_index_metadata(root: Path) -> dict[str, str]:
    """The previous index's own metadata (alias records, user keys), without the computed sizes."""
    p = root / L.ST_INDEX
    if not p.is_file():
        return {}
    idx = read_index(p)
    return {k: v for k, v in idx.metadata.items()
            if k not in ("total_size", "total_parameters") and isinstance(v, str)}


def _with(opts: ExportOptions, overwrite: bool, default_shard: str = "5GB") -> ExportOptions:
    from dataclasses import replace

    return replace(opts, overwrite=overwrite, max_shard_size=opts.max_shard_size or default_shard)
