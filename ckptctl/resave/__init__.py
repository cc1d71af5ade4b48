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

Which family is kept (``analyze``): the saves the directory holds (``saves.split``: the index
with its shards, each ``-of-N`` shard set the index does not name, the single file) ranked by
``layout.choose``: the one complete save consistent with config.json is kept; two such saves are
refused (exit 2) with each listed and the ``--prefer`` that names it; ``--prefer`` takes a kind,
``index``/``single`` or any file of a family.

What cannot be repaired without data that is not there (a truncated or missing shard, a corrupt
header, a tensor stored twice with different bytes, tensors the index names that no file holds)
is refused with exit 1 and a list of what is lost; nothing is changed. A repair's staged result is
verified before it is published: any error left refuses it the same way.

Modules: ``analyze`` (the choice and its fixes), ``saves`` (splitting and assessing saves),
``keep`` (the keep-layout plan and the nothing-to-do test), ``root`` (a multi-component root,
resaved whole), this module (``resave``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ckptctl import layout as L
from ckptctl.errors import InputError, UnrepairableError, UsageError
from ckptctl.findings import ERROR, Finding
from ckptctl.gcpause import paused
from ckptctl.format import names as N
from ckptctl.layout.reading import MetadataReading
from ckptctl.resave.analyze import Chosen, Repair, analyze
from ckptctl.layout.version import Held, one_version
from ckptctl.resave.keep import (KeptFiles, already_so, keep_layout_plan, keep_layout_source, kept_files,
                                 link_matching, note_index_changes, own_metadata)
from ckptctl.write.result import ExportResult
from ckptctl.write.options import ExportOptions, ExportSettings, validate

if TYPE_CHECKING:
    from ckptctl.plan import Plan
    from ckptctl.write.inputs import Entry
    from ckptctl.write.tree import RootResult

__all__ = ["PREFER", "Chosen", "Repair", "ResaveResult", "analyze", "resave"]


@dataclass
class ResaveResult:
    """A resave's write, the repair it made, and whether it left the checkpoint unchanged."""

    export: ExportResult
    repair: Repair
    unchanged: bool = False  # --repair of a healthy checkpoint: nothing written, nothing published

    def to_dict(self) -> dict[str, Any]:
        doc = self.export.to_dict()
        doc["fixes"] = self.repair.fixes
        doc["unchanged"] = self.unchanged
        doc["dropped"] = self.repair.dropped
        return doc


PREFER = ("index", "single", L.SAFETENSORS, L.PYTORCH)


def _check_prefer(prefer: str | None) -> None:
    """``--prefer`` is a kind, index|single, or a family's file name (checked against the
    directory's families later, by ``layout.choose``)."""
    if prefer is None or prefer in PREFER:
        return
    if "/" in prefer or not (N.parse_weights_name(prefer) or N.parse_index_name(prefer)
                             or N.is_safetensors(prefer)):
        raise UsageError(f"unknown --prefer {prefer!r}",
                         f"use {', '.join(PREFER)}, or the file name of a family as `resave --repair` lists them")


def resave(root: str | os.PathLike[str], opts: ExportOptions, *, output: str | os.PathLike[str] | None = None,
           repair: bool = False, prefer: str | None = None, link: bool = False,
           whole_root: bool = True, static: bool = False) -> ResaveResult | RootResult:
    """Rewrite the checkpoint at ``root`` (in place, or into ``output``): re-plan when a shard
    size or dtype is given, else keep its layout and repair what is certain. ``link``: into
    ``output``, hard-link unchanged shards instead of cloning or copying them. ``prefer``: a kind,
    ``index``/``single``, or one family's file name. In place, a symlinked ``root`` is rewritten
    where it points (the link stays a link). A repair publishes only a version that verifies
    clean. ``whole_root``: a multi-component root is resaved as a whole (:mod:`ckptctl.resave.root`);
    False when that writer resaves the root's own module 0 as one model. ``static``: the repair's
    verify runs the static rules only (``verify --static``: no model-class check, no import of
    torch and the model's library)."""
    # the metadata of every tensor: acyclic, freed by reference counting
    with paused():
        return _resave(Path(root), opts, output=output, repair=repair, prefer=prefer, link=link,
                       whole_root=whole_root, static=static)


def _resave(root: Path, opts: ExportOptions, *, output: str | os.PathLike[str] | None,
            repair: bool, prefer: str | None, link: bool, whole_root: bool,
            static: bool) -> ResaveResult | RootResult:
    """:func:`resave`'s steps."""
    # Every option is checked before anything touches the filesystem (a recovery renames).
    _check_prefer(prefer)
    if output:  # the destinations export refuses: the source itself, inside it, or a folder that holds it
        from ckptctl.write.inputs import check_paths

        check_paths(root, Path(output))
    # what this command reads of the directory's metadata, read once; a repair ends with a verify,
    # whose config rules' facts a worker may draw from the index as it is read (verify's names work)
    if repair:
        from ckptctl.verify.model import name_facts

        reading = MetadataReading(names_work=name_facts)
    else:
        reading = MetadataReading()
    held = Held.open(root)  # the version the first scan reads (layout.version); closed by one_version
    try:
        first = L.scan(root, reading=reading) if root.is_dir() else None  # reused below unless a recovery changed it
        if whole_root and first is not None and first.kind in L.ROOTS:  # a pipeline or sentence-transformers root
            from ckptctl.resave.root import resave_root  # the tree writer, imported only for a root

            if held is not None:
                held.close()
            return resave_root(root, opts, resave_one=resave, output=output, repair=repair, prefer=prefer,
                               link=link, lay=first, static=static)
        # In place, unchanged shards are hard-linked (one name survives the publish); into --output
        # they are cloned or copied (an independent copy) unless the caller asked for links.
        opts = replace(opts, overwrite=True if not output else opts.overwrite, link_unchanged=not output or link)
        settings = validate(opts)
        if not output and os.path.islink(root):  # rewrite the target; publishing onto the link would replace it
            root = Path(os.path.realpath(root))
            first = None
        if not opts.dry_run:  # a dead writer's half-done publish of this very directory comes first
            from ckptctl.staging import recover_destination

            if recover_destination(Path(os.path.abspath(root))):
                first = None  # rolled forward or back: scanned again
        if not root.is_dir():
            raise InputError(f"{root} is not a checkpoint directory", "resave works on a directory")
    except BaseException:
        if held is not None:
            held.close()
        raise
    replan = opts.dtype not in (None, "keep") or (opts.max_shard_size is not None and not settings.keep_layout)
    # The analysis reads one version of the directory (another writer's publish may replace it
    # meanwhile): made again on the version now published when it was replaced while it was read.
    ana = one_version(root, lambda attempt: _analysis(root, prefer=prefer, repair=repair, lay=first if attempt == 0
                                                      and held is not None else None, reading=reading, keep=not replan,
                                                      unchanged_ok=repair and not output), held=held)
    chosen, rep = ana.chosen, ana.rep
    dest = Path(output) if output else root
    check = _verified(dest, static, reading) if repair else None
    extras: dict[str, Path | bytes] = {}
    if opts.dtype not in (None, "keep") and (root / N.CONFIG).is_file():
        extras[N.CONFIG] = root / N.CONFIG  # rewritten with the new dtype
    if output:
        for n in sorted(os.listdir(root)):
            if n in L.COPIED_EXTRAS and n not in extras:
                extras[n] = root / n
    if not chosen.files:  # pickles: read through torch like an export
        from ckptctl.sources.opener import open_source

        with open_source(root, only=L.PYTORCH, reading=reading) as src:  # read (weights_only) even to find it sound
            if repair and not replan and not output and not rep.fixes:
                return _unchanged(dest, opts, rep, chosen.errors, static, reading)  # a sound pickle checkpoint
            from ckptctl.write.inputs import build_inputs, entries_for
            from ckptctl.write.job import write_inputs

            inputs = build_inputs(entries_for(src, opts.dtype), opts, settings, extras=extras, aliases=src.aliases,
                                  source=src)
            return ResaveResult(write_inputs(inputs, dest, check=check, reading=reading), rep)
    opts = replace(opts, prefix=chosen.stem, variant=chosen.variant)
    if not replan:
        assert ana.kept is not None
        if ana.unchanged:
            return _unchanged(dest, opts, rep, chosen.errors, static, reading)
    # the writer, imported only once something is written (a repair with nothing to do needs none)
    from ckptctl.write.inputs import build_inputs, entries_for
    if replan:
        from ckptctl.sources.safetensors_source import SafetensorsSource

        src = SafetensorsSource.open(root, chosen.files, reading=reading)
        entries = entries_for(src, opts.dtype)
        # --dtype alone keeps the shard boundaries (each file's tensors stay together); a size re-plans
        groups = _file_groups(entries) if opts.max_shard_size is None or settings.keep_layout else None
        plan = _replan(entries, settings, src.metadata or None, opts, groups)
        link_matching(plan, root, entries)
        inputs = build_inputs(entries, opts, settings, extras=extras)
    else:
        assert ana.kept is not None
        plan, kept = keep_layout_plan(ana.kept)
        if rep.lost:  # DESIGN.md I9: no tensor lost
            raise UnrepairableError(
                f"{root}: {len(rep.lost)} tensor(s) the index names are in no file: {', '.join(rep.lost[:8])}"
                + (" ..." if len(rep.lost) > 8 else "") + "; rebuilding the index around them would lose them",
                "restore the files that hold them from a copy; nothing was changed")
        src, entries = keep_layout_source(root, kept)
        inputs = build_inputs(entries, opts, settings, extras=extras, metadata=ana.metadata)
    from ckptctl.write.job import write_inputs

    return ResaveResult(write_inputs(inputs, dest, plan=plan, check=check, reading=reading), rep)


@dataclass
class _Analysis:
    """What a resave read of the directory before it writes (one version of it): the save kept,
    the repair, and for keep-layout the plan decided file by file and whether it is the
    directory as it already is."""

    chosen: Chosen
    rep: Repair
    kept: KeptFiles | None = None
    metadata: dict[str, str] | None = None
    unchanged: bool = False


def _analysis(root: Path, *, prefer: str | None, repair: bool, lay: L.Layout | None, reading: MetadataReading,
              keep: bool, unchanged_ok: bool) -> _Analysis:
    """:func:`analyze`, then (``keep``: keep-layout) the files kept and the fixes they imply;
    ``unchanged_ok``: a repair in place may find the plan is the directory as it is."""
    chosen, rep = analyze(root, prefer=prefer, repair=repair, lay=lay, reading=reading)
    ana = _Analysis(chosen, rep)
    if not chosen.files or not keep:
        return ana
    kf = ana.kept = kept_files(root, chosen, rep)  # the plan decided, no record per tensor made yet
    same_map = None  # the old index's map against the plan's, said once for both checks
    if kf.index_name and chosen.index is not None:
        ana.metadata = own_metadata(chosen.index)
        same_map = kf.same_map_as(chosen.index)
        note_index_changes(chosen.index, kf, rep, same_map=same_map)
    # before the plan's records and any input (a tensor lost is a fix: never "already so")
    ana.unchanged = unchanged_ok and already_so(root, chosen, kf, rep, same_map=same_map)
    return ana


def _verified(dest: Path, static: bool, reading: MetadataReading) -> Callable[[Path], None]:
    """The last step of a repair, on the staged version before it is published: ckptctl's own
    verify. Any error left (a tensor the config requires that no file holds, ...) refuses the
    repair with exit 1 and what is lost; the staged version is removed and nothing changes."""

    def check(data: Path) -> None:
        from ckptctl.verify import VerifyOptions, verify_path

        res = verify_path(data, display=str(dest), options=VerifyOptions(static=static, reading=reading))
        errors = [f for f in res.findings if f.severity == ERROR]
        if not errors:
            return
        staged = str(data)
        what = [f.message.replace(staged, str(dest)) for f in errors[:4]]
        raise UnrepairableError(
            f"{dest}: the repaired checkpoint would still fail verify with {len(errors)} error(s): " + "; ".join(what),
            "the data is not there: restore what is missing from a copy (`ckptctl verify` shows the details); "
            "nothing was changed", phase="verify")

    return check


def _unchanged(dest: Path, opts: ExportOptions, rep: Repair, errors: list[Finding] | None = None,
               static: bool = False, reading: MetadataReading | None = None) -> ResaveResult:
    """The result of a repair that found nothing to do: no staging, no publish. "Sound" is
    verify's word, not the repair's: the directory is verified (the same findings ``ckptctl
    verify`` reports), and an error left (a layout finding the repair has no certain fix for, an
    untied model without its lm_head, ...) refuses with exit 1, naming each and saying it is not
    repairable, with the first one's own next step (never a loop back to --repair)."""
    from ckptctl.verify import VerifyOptions, verify_path

    found = [f for f in verify_path(dest, options=VerifyOptions(static=static, reading=reading)).findings
             if f.severity == ERROR]
    left = found or list(errors or [])
    if left:
        named = "; ".join(f"[{f.code}] {f.message}" for f in left[:4]) + (" ..." if len(left) > 4 else "")
        hint = next((f.hint for f in left if f.hint and "resave --repair" not in f.hint), None)
        raise UnrepairableError(f"{dest}: resave --repair has no certain fix for {len(left)} error(s) verify finds; "
                                f"they are not repairable: {named}",
                                (hint or f"run `ckptctl verify {dest}` for the details") + "; nothing was changed",
                                phase="verify")
    return ResaveResult(ExportResult(dest=str(Path(os.path.abspath(dest))), dry_run=opts.dry_run), rep, unchanged=True)


def _file_groups(entries: list[Entry]) -> list[list[str]]:
    """The tensors grouped by the file they sit in, the files in name order (the shard order)."""
    by_file: dict[str, list[str]] = {}
    for e in entries:
        by_file.setdefault(str(e.tensor.file), []).append(e.name)
    return [by_file[f] for f in sorted(by_file)]


def _replan(entries: list[Entry], settings: ExportSettings, metadata: dict[str, str] | None,
            opts: ExportOptions, groups: list[list[str]] | None = None) -> Plan:
    from ckptctl.plan import make_plan

    try:
        return make_plan([e.spec for e in entries], max_shard_size=settings.max_shard_size, metadata=metadata,
                         prefix=opts.prefix, variant=opts.variant, groups=groups)
    except ValueError as exc:
        raise InputError(str(exc), "check the tensor names and --max-shard-size") from None
