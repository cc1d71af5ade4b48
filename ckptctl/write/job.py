"""One export, step by step: plan, stage, write, finalize, publish.

:class:`ExportJob` holds the steps; :func:`write_inputs` runs them in one process (the multi-rank
writer in ``ckptctl.distributed`` runs the same steps across ranks, under the same phase names).
``plan`` checks the tensor names and plans from metadata alone, then (the first I/O) finishes
any half-done publish a dead writer left for the destination, checks the destination and decides
what its old version loses and keeps; ``stage`` checks free space and creates the staging
directory; ``write`` creates each shard (header, data area) and fills it, fsyncing in the
background; ``finalize`` writes the index, the extras, the carried files and the manifest and
seals the directory; ``publish`` makes it the destination. Any failure before publish removes
the staging directory and leaves the destination untouched.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ckptctl import _faults
from ckptctl import layout as L
from ckptctl.errors import (CkptctlError, DiskFullError, InputError, Interrupted, OperationalError, UsageError,
                            from_oserror)
from ckptctl.format.index import encode_index
from ckptctl.manifest import MANIFEST_NAME, add_late_files, build_manifest, encode_manifest, list_files
from ckptctl.plan import Locate, Plan, make_plan, place_for_clone, with_alias_records
from ckptctl.publish import Stage, check_destination, check_writable, free_space
from ckptctl.staging import recover_destination
from ckptctl.staging.keep import entries
from ckptctl.write.extras import read_extras
from ckptctl.write.inputs import Entry, ExportInputs, build_inputs
from ckptctl.write.options import ExportOptions, ProgressEvent, validate
from ckptctl.write.result import ExportResult
from ckptctl.write.files import clone_block, copy_file, link_or_copy
from ckptctl.write.filling import fill_shards
from ckptctl.write.shards import source_range
from ckptctl.write.superseded import replacement

BLOCK_MARGIN = 4096  # per file written: the last partial block, directory entries
CARRY_TRIES = 4  # a carried file replaced by its writer while it is linked: looked up again this often


def index_entries(entries: list[Entry]) -> dict[str, Entry]:
    """The entries by name: the one check that no tensor name is given twice."""
    by_name = {e.spec.name: e for e in entries}
    if len(by_name) != len(entries):
        seen: set[str] = set()  # the first name given twice, for the message
        twice = next(n for n in (e.spec.name for e in entries)
                     if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        raise InputError(f"tensor {twice!r} is given twice", "tensor names must be unique")
    return by_name


def source_groups(entries: list[Entry]) -> list[list[str]]:
    """``--max-shard-size keep``: the tensors grouped by the source file they sit in, in source
    order."""
    groups: dict[str, list[str]] = {}
    for e in entries:
        if e.tensor.file is None:
            raise UsageError("--max-shard-size keep needs a source stored in files",
                             "give a size such as 5GB for this source")
        groups.setdefault(e.tensor.file, []).append(e.name)
    return list(groups.values())


class ExportJob:
    """One export of ``inputs`` to ``dest``, in steps: :meth:`prepare` (the plan; all a dry run
    does), :meth:`stage`, :meth:`write_shards`, :meth:`finalize` and :meth:`publish`; :meth:`abort`
    on failure. ``plan`` replaces the computed plan (resave's keep-layout plan)."""

    def __init__(self, inputs: ExportInputs, dest: str | os.PathLike[str], *, plan: Plan | None = None,
                 reading: Any = None) -> None:
        self.started = time.monotonic()
        self.reading = reading  # the command's MetadataReading, when the destination is what it read (resave)
        self.inputs = inputs
        self.entries = inputs.entries
        self.opts: ExportOptions = inputs.options
        self.dest = Path(os.path.abspath(dest))
        self.result = ExportResult(dest=str(self.dest), dry_run=self.opts.dry_run, aliases=dict(inputs.aliases),
                                   notes=list(inputs.source.notes) if inputs.source else [])
        self.by_name: dict[str, Entry] = {}
        self.plan: Plan | None = plan
        self.extra_blobs: dict[str, bytes] = {}
        self.stage_: Stage | None = None
        self.dest_existed = False
        self.known: dict[str, int] = {}  # dest's entries at every depth (relative path -> inode) as the plan saw them
        # --manifest: the files hashed as they were written, name -> (size, sha256 or its future)
        self.digests: dict[str, tuple[int, Any]] = {}
        self._locate: Locate | None = None
        self.clones = False  # the destination's filesystem can share blocks with a source (place_for_clone)
        self._hash_stop = threading.Event()  # the job failed: digests still being read stop

    def prepare(self, *, recover: bool = True, place: bool = False) -> ExportResult:
        """Plan from metadata (no I/O), then look at the destination: finish a dead writer's
        half-done publish there (unless a dry run, or ``recover=False`` on ranks that are not the
        leader), check it, decide what its old version loses and keeps, read the extras. With
        ``place`` (one process only: it probes the filesystem), pad the planned headers so that
        each shard's largest run can be cloned, where the destination's filesystem can clone."""
        opts, result, dest = self.opts, self.result, self.dest
        if not self.entries:
            raise InputError("there are no tensors to write", "check the source: it holds no weights")
        self.by_name = index_entries(self.entries)
        if self.plan is None:
            groups = source_groups(self.entries) if self.inputs.settings.keep_layout else None
            try:
                self.plan = make_plan([e.spec for e in self.entries],
                                      max_shard_size=self.inputs.settings.max_shard_size, prefix=opts.prefix,
                                      metadata=opts.metadata, aliases=result.aliases,
                                      single_file=opts.single_file, groups=groups, variant=opts.variant)
            except ValueError as exc:
                raise InputError(str(exc), "check the tensor names and --max-shard-size") from None
            if place:
                self.place_for_clone()
        plan = self.plan
        if recover and not opts.dry_run:
            result.recovered = recover_destination(dest)
        self.dest_existed = check_destination(dest, overwrite=opts.overwrite)
        # Listed before the plan's own listing: whatever appears later is carried at publish.
        self.known = entries(dest) if self.dest_existed else {}
        self.extra_blobs = read_extras(self.inputs.extras, self.entries)
        result.index = plan.index_name
        result.tensors = len(self.entries)
        result.parameters = plan.total_parameters
        result.total_size = plan.total_size
        result.bytes_to_write = (plan.bytes_to_write + sum(len(b) for b in self.extra_blobs.values())
                                 + sum(_size(p) for p in self.inputs.variants.values()))
        result.files = [{"name": s.name, "size": s.file_size, "tensors": len(s.specs),
                         "linked_from": s.link_from} for s in plan.shards]
        result.linked = [s.name for s in plan.shards if s.link_from]
        result.extras = sorted(self.extra_blobs)
        result.variants = sorted(self.inputs.variants)
        if self.dest_existed:
            result.removed, result.carried = replacement(
                dest, slot=L.slot_of(opts.prefix, opts.variant), written=[*plan.files, *self.extra_blobs],
                variants=self.inputs.variants, reading=self.reading)
        result.converted = sum(1 for e in self.entries if e.converted)
        result.manifest = MANIFEST_NAME if opts.manifest else None
        result.space_available = _free_space_near(dest)
        if opts.progress:
            opts.progress(ProgressEvent("plan", total=plan.total_size))
        return result

    def place_for_clone(self) -> None:
        """Pad each planned header so its largest run of source bytes can be cloned (only where
        the destination's filesystem can clone from that source)."""
        assert self.plan is not None
        block, ok = _probe_clones(self.entries, self.dest)
        if not ok:
            return
        self.clones = True
        locate = self.locate()
        for shard in self.plan.shards:
            self.result.header_padding += place_for_clone(
                shard, lambda name: (w if (w := locate(name)) is not None and w[0] in ok else None), block)

    def locate(self) -> Locate:
        """Where each entry's bytes sit unchanged in a source file (made once for every shard)."""
        if self._locate is None:
            self._locate = source_range(self.by_name)
        return self._locate

    def stage(self) -> Path:
        """Check the parent and its free space, create the staging directory; returns its data/."""
        assert self.plan is not None
        self.stage_ = Stage(self.dest, fsync=self.opts.fsync, command=self.opts.command, known=self.known)
        return create_stage(self.stage_, self.result.bytes_to_write,
                            files=len(self.plan.files) + len(self.extra_blobs) + 4)

    def write_shards(self, data: Path) -> None:
        """Create and fill (or link) every shard in ``data`` (:func:`~ckptctl.write.filling.fill_shards`)."""
        assert self.plan is not None
        fill_shards(self.plan, self.by_name, data, self.opts, result=self.result, locate=self.locate,
                    allocate=not self.clones, digests=self.digests, stop=self._hash_stop)

    def finalize(self) -> None:
        """Index, extras, the old version's kept files, manifest; then fsync and mark ready."""
        assert self.plan is not None and self.stage_ is not None
        plan, opts, stage, data = self.plan, self.opts, self.stage_, self.stage_.data
        if opts.progress:
            opts.progress(ProgressEvent("finalize"))
        try:
            if plan.index_name:
                _faults.point("index")
                self.write_file(plan.index_name, encode_index(
                    plan.weight_map, plan.total_size, total_parameters=plan.total_parameters,
                    extra_metadata=with_alias_records(opts.metadata, plan.aliases)))
            for name, blob in sorted(self.extra_blobs.items()):
                self.write_file(name, blob)
            for name in self.result.carried:
                carry(self.dest / name, data / name, fsync=opts.fsync)
            for name, path in sorted(self.inputs.variants.items()):
                copy_verbatim(path, data / name, fsync=opts.fsync)
            _faults.point("extras-written")
            if opts.manifest:
                stage.write_file(MANIFEST_NAME, encode_manifest(build_manifest(
                    data, list_files(data), label=opts.label, final=self.dest, known=self.written_digests())))
            _faults.point("manifest-written")
        except OSError as exc:
            raise from_oserror(exc, "cannot write the index and extras", phase="finalize") from None
        stage.seal()
        stage.check_competitors()

    def write_file(self, name: str, blob: bytes) -> None:
        """A small file of the new version (index, extra), hashed from memory for the manifest."""
        assert self.stage_ is not None
        self.stage_.write_file(name, blob)
        if self.opts.manifest:
            self.digests[name] = (len(blob), hashlib.sha256(blob).hexdigest())

    def written_digests(self) -> dict[str, tuple[int, str]]:
        """The files hashed while they were written: name -> (size, sha256). A shard whose
        writes did not go in file order is left out (the manifest reads it)."""
        out = {}
        for name, (size, digest) in self.digests.items():
            value = digest if isinstance(digest, str) else digest.result()
            if value is not None:
                out[name] = (size, value)
        return out

    def publish(self) -> ExportResult:
        """Make the staged version the destination, then remove the staging directory."""
        assert self.stage_ is not None and self.plan is not None
        if self.opts.progress:
            self.opts.progress(ProgressEvent("publish"))
        self.result.publish = self.stage_.publish(replace=self.dest_existed)
        self.result.carried += self.stage_.late + self.stage_.kept_aside  # added to dest while we wrote
        _faults.point("after-publish")
        self.stage_.finish()
        if self.opts.manifest and (self.stage_.late or self.stage_.kept_aside):
            list_late_files(self.dest, self.stage_.late + self.stage_.kept_aside, fsync=self.opts.fsync)
        self.result.seconds = time.monotonic() - self.started
        if self.opts.progress:
            self.opts.progress(ProgressEvent("done", done=self.plan.total_size, total=self.plan.total_size))
        return self.result

    def abort(self) -> None:
        self._hash_stop.set()
        if self.stage_ is not None:
            self.stage_.abort()


def create_stage(stage: Stage, bytes_to_write: int, *, files: int) -> Path:
    """Check the destination's parent (created when missing), that it is writable and has room
    for ``bytes_to_write`` bytes in ``files`` files, then create ``stage``; returns its data/."""
    parent = stage.dest.parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise from_oserror(exc, "cannot create the destination's parent", phase="plan") from None
    check_writable(parent)
    avail = free_space(parent)
    if avail < bytes_to_write + BLOCK_MARGIN * files:
        raise DiskFullError(
            f"not enough free space in {parent}: need {bytes_to_write:,} bytes, "
            f"{avail:,} available", "free space or write elsewhere; nothing was written", phase="plan")
    data = stage.create()
    stage.check_competitors()
    return data


def list_late_files(dest: Path, names: list[str], *, fsync: bool) -> None:
    """After the publish: the manifest lists ``names``, the files carried into the new version
    after it was written (:func:`~ckptctl.manifest.add_late_files`)."""
    try:
        add_late_files(dest, names, fsync=fsync)
    except OSError as exc:
        cause = from_oserror(exc, "cannot add them to the manifest")
        raise OperationalError(
            f"{dest} holds the new version, but the files added to it while we wrote are not in its manifest: "
            f"{cause.message}", f"run `ckptctl resave {dest} --manifest` to write it again", phase="publish") from None


def _probe_clones(entries: list[Entry], dest: Path) -> tuple[int, set[str]]:
    """:func:`~ckptctl.write.files.clone_block` of the source files ``entries`` copy unconverted;
    nothing clones when the probe itself fails (no inode left, too many open files): it only
    asks, and the writes then report what is wrong with the filesystem."""
    try:
        return clone_block((e.tensor.file for e in entries if e.tensor.file and not e.converted), dest)
    except OSError:
        return 0, set()


def write_inputs(inputs: ExportInputs, dest: str | os.PathLike[str], *, plan: Plan | None = None,
                 check: Callable[[Path], None] | None = None, reading: Any = None) -> ExportResult:
    """Write ``inputs`` as a safetensors checkpoint and publish it at ``dest`` atomically (all of
    :class:`ExportJob`'s steps in this process). ``check`` sees the staged version before the
    publish; what it raises aborts (resave --repair's verify). ``reading``: the command's metadata
    reading, when it has read ``dest`` already (resave in place: the old version's index and
    headers are not parsed again). Errors name the step they failed in."""
    job = ExportJob(inputs, dest, plan=plan, reading=reading)
    result = job.prepare(place=True)
    if inputs.options.dry_run:
        result.seconds = time.monotonic() - job.started
        return result
    phase = "stage"
    try:
        data = job.stage()
        phase = "write"
        job.write_shards(data)
        phase = "finalize"
        job.finalize()
        if check is not None:
            check(data)
        phase = "publish"
        result = job.publish()
    except BaseException as exc:
        failed(job.stage_, job.dest, exc, phase)
        raise
    return result


def failed(stage: Stage | None, dest: Path, exc: BaseException, phase: str) -> None:
    """After ``exc`` in ``phase``: remove the staging directory (never a half-published one), turn
    a Ctrl-C after the publish into :class:`Interrupted` (the new version is in place), name the
    phase on an error that has none. The caller re-raises."""
    published = stage is not None and stage.published
    if stage is not None:
        stage.abort()
    if isinstance(exc, KeyboardInterrupt) and published:
        raise Interrupted(f"interrupted after publishing: {dest} holds the new version",
                          "nothing to redo; `ckptctl gc-tmp` removes anything left behind",
                          phase="cleanup") from None
    if isinstance(exc, CkptctlError) and exc.phase is None:
        exc.phase = phase


def write_checkpoint(entries: list[Entry], dest: str | os.PathLike[str], opts: ExportOptions, *,
                     extras: dict[str, Path | bytes] | None = None, aliases: dict[str, str] | None = None,
                     adapter: bool = False, plan: Plan | None = None) -> ExportResult:
    """:func:`write_inputs` for entries a caller made itself (resave, ``CheckpointWriter``):
    validates ``opts`` first. ``extras`` maps file names to a path or bytes."""
    settings = validate(opts)
    return write_inputs(build_inputs(entries, opts, settings, extras=extras, aliases=aliases, adapter=adapter),
                        dest, plan=plan)


def copy_verbatim(src: Path, dst: Path, *, fsync: bool) -> str:
    """An independent copy of the source's file ``src`` at ``dst``: a link (an HF cache snapshot's
    link to its blob) is followed and the regular file it names copied (cloned where possible)."""
    real = Path(os.path.realpath(src))
    if not stat.S_ISREG(os.stat(real).st_mode):
        raise InputError(f"{src} is not a regular file", "replace it with the file itself")
    return copy_file(real, dst, fsync=fsync)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise from_oserror(exc, f"cannot read {path}", phase="plan") from None


def _free_space_near(dest: Path) -> int | None:
    """Free bytes on the filesystem that will hold ``dest`` (its nearest existing ancestor)."""
    probe = dest.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return free_space(probe)
    except OSError:
        return None


def carry(src: Path, dst: Path, *, fsync: bool) -> None:
    """A file of the old version brought into the new one (:func:`link_or_copy`). One its writer
    replaces by a rename while it is linked (an editor's save, a job's log rotated) fails the link
    with ENOENT: Linux does not link an inode whose last name just went. The name still holds a
    file, the one now there, and that is carried instead: looked up again, at most
    :data:`CARRY_TRIES` times, while nothing was made at ``dst``. A name gone for good still fails."""
    for attempt in range(CARRY_TRIES):
        try:
            link_or_copy(src, dst, fsync=fsync)
            return
        except FileNotFoundError:
            if attempt + 1 == CARRY_TRIES or not os.path.lexists(src) or os.path.lexists(dst):
                raise

