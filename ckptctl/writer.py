"""The streaming shard writer and the export of a tensor set to a published checkpoint.

Flow (DESIGN.md section 2): recover any half-done publish a dead writer left for the destination;
plan from metadata; check the destination and free space; stage; write each shard (header, then each tensor's
bytes: ranges of safetensors files are copied by the kernel with ``copy_file_range``, everything
else streams in bounded chunks); write the index, the extras, the destination's non-weight files
(hard links) and the manifest; fsync; publish; remove the staging directory. Any failure before
publish removes the staging directory and leaves the destination untouched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ckptctl import _faults, layout as L
from ckptctl.errors import CkptctlError, DiskFullError, InputError, Interrupted, UsageError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import TensorSpec
from ckptctl.format.index import encode_index
from ckptctl.manifest import MANIFEST_NAME, build_manifest, encode_manifest
from ckptctl.plan import Plan, ShardPlan, make_plan
from ckptctl.publish import Stage, check_destination, check_writable, free_space, recover_destination
from ckptctl.sizes import parse_size
from ckptctl.sources.base import CHUNK_BYTES, Source, SourceTensor

DEFAULT_MAX_SHARD_SIZE = "5GB"
BLOCK_MARGIN = 4096  # per file written: the last partial block, directory entries


@dataclass
class ProgressEvent:
    phase: str  # plan | write | shard-done | finalize | publish | done
    file: str | None = None
    done: int = 0
    total: int = 0
    message: str | None = None


ProgressFn = Callable[[ProgressEvent], None]


@dataclass
class Entry:
    """One tensor to write: where its bytes come from and the dtype to store it as."""

    source: Source
    tensor: SourceTensor
    dtype: str  # stored dtype (== tensor.dtype unless converted)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.tensor.name, self.dtype, self.tensor.shape)


@dataclass
class ExportResult:
    dest: str
    dry_run: bool
    files: list[dict[str, Any]] = field(default_factory=list)  # written: name, size
    index: str | None = None
    tensors: int = 0
    parameters: int = 0
    total_size: int = 0
    bytes_to_write: int = 0
    space_available: int | None = None  # free bytes on the destination's filesystem at planning time
    bytes_copied_by_kernel: int = 0
    bytes_streamed: int = 0
    extras: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)  # shards hard-linked from unchanged files
    carried: list[str] = field(default_factory=list)  # dest's non-weight files kept
    removed: list[str] = field(default_factory=list)  # dest's files the new version drops
    aliases: dict[str, str] = field(default_factory=dict)
    converted: int = 0
    publish: str | None = None
    manifest: str | None = None
    recovered: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ExportOptions:
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    dtype: str | None = None  # keep | bf16 | fp16 | fp32 (None = keep)
    overwrite: bool = False
    fsync: bool = True
    manifest: bool = False
    label: str | None = None
    dry_run: bool = False
    metadata: dict[str, str] | None = None
    prefix: str = "model"
    single_file: bool = False  # adapters: always one file
    command: str | None = None
    progress: ProgressFn | None = None
    chunk_bytes: int = CHUNK_BYTES


def _target_dtype(option: str | None) -> str | None:
    if option in (None, "", "keep"):
        return None
    try:
        return dt.TARGETS[option]
    except KeyError:
        raise UsageError(f"unknown --dtype {option!r}", "use keep, bf16, fp16 or fp32") from None


def entries_for(source: Source, dtype_option: str | None) -> list[Entry]:
    target = _target_dtype(dtype_option)
    out = []
    for t in source.tensors:
        stored = target if target and t.dtype in dt.CONVERTIBLE else t.dtype
        out.append(Entry(source, t, stored))
    return out


# ----------------------------------------------------------------------------------------------
# What happens to the destination's existing files


def superseded(dest: Path, *, adapter: bool) -> tuple[list[str], list[str]]:
    """(files the new version drops, files carried over) among ``dest``'s top-level entries.

    Exporting a full model drops every model weights family (safetensors or pickle, single or
    sharded, with indexes), DCP files, any other top-level ``*.safetensors`` a glob-loader would
    pick up, and temp leftovers; it keeps adapters. Exporting an adapter drops only the adapter's
    weights. Everything else (config, tokenizer, README, optimizer state, directories) is kept.
    """
    if not os.path.isdir(dest):
        return [], []
    lay = L.scan(dest)
    drop: set[str] = set(lay.leftovers)
    for fam in lay.families:
        if (fam.kind == L.PEFT) == adapter:
            drop.update(fam.all_files)
    names = sorted(os.listdir(dest))
    if not adapter:
        for n in names:
            if n.endswith(".safetensors") and not n.startswith("adapter_model"):
                drop.add(n)
            if n.startswith("pytorch_model") and n.endswith((".bin", ".bin.index.json")):
                drop.add(n)  # variants too (pytorch_model.fp16.bin): a loader may still pick them
            if n.endswith((".safetensors.index.json", ".bin.index.json")) or n == ".metadata":
                drop.add(n)
    drop.add(MANIFEST_NAME)  # it describes the old version: never carry it over
    keep = [n for n in names if n not in drop]
    return sorted(drop & set(names)), keep


def _link_or_copy(src: Path, dst: Path, *, fsync: bool = True) -> None:
    """Hard-link a file (copy where linking fails, and fsync the copy); recreate symlinks;
    recurse into directories."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        os.mkdir(dst)
        for child in sorted(os.listdir(src)):
            _link_or_copy(src / child, dst / child, fsync=fsync)
    else:
        try:
            os.link(src, dst)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
            shutil.copy2(src, dst)
            if fsync:
                fd = os.open(dst, os.O_RDONLY | os.O_CLOEXEC)
                _fsync_and_close(fd)


def _sync_config_dtype(raw: bytes, stored: str) -> bytes:
    """config.json with its ``dtype``/``torch_dtype`` fields set to the stored dtype."""
    try:
        cfg = json.loads(raw)
    except ValueError:
        return raw
    name = dt.CONFIG_NAMES.get(stored)
    if not isinstance(cfg, dict) or name is None:
        return raw
    changed = False
    for c in [cfg] + [v for v in cfg.values() if isinstance(v, dict) and "model_type" in v]:
        for key in ("dtype", "torch_dtype"):
            if key in c and c[key] != name:
                c[key] = name
                changed = True
    if not changed:
        return raw
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8")


# ----------------------------------------------------------------------------------------------
# Writing one shard


def _copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
    """Copy with copy_file_range; returns the bytes it copied (less when the kernel cannot)."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, src_offset + done, dst_offset + done)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                return done
            raise
        if n == 0:
            raise InputError("source shard is shorter than its header says",
                             "the source is truncated: verify and repair it first")
        done += n
    return done


def _pwrite_all(fd: int, data: Any, pos: int) -> int:
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        n = os.pwrite(fd, view, pos)
        view = view[n:]
        pos += n
    return total


class TensorWriter:
    """Writes tensors' bytes at given file positions: kernel copy for unchanged safetensors
    ranges, bounded chunks for everything else. Used by the single-process and multi-rank writers."""

    def __init__(self, chunk_bytes: int, result: ExportResult) -> None:
        self.chunk_bytes = chunk_bytes
        self.result = result
        self._src_fds: dict[str, int] = {}

    def close(self) -> None:
        for fd in self._src_fds.values():
            os.close(fd)
        self._src_fds.clear()

    def _src_fd(self, path: str) -> int:
        fd = self._src_fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._src_fds[path] = fd
        return fd

    def write(self, fd: int, pos: int, e: Entry, length: int) -> None:
        t = e.tensor
        copied = 0
        if e.dtype == t.dtype and t.file is not None and t.offset is not None and length:
            copied = _copy_range(self._src_fd(t.file), fd, t.offset, pos, length)
            self.result.bytes_copied_by_kernel += copied
        if copied < length:
            written = copied
            for chunk in _chunks_from(e, copied, self.chunk_bytes):
                n = _pwrite_all(fd, chunk, pos + written)
                written += n
                self.result.bytes_streamed += n
                _faults.point("write-chunk")
            if written != length:
                raise InputError(f"tensor {t.name!r}: source gave {written} bytes, expected {length}",
                                 "the source is truncated or changed while it was read")
        _faults.point("write-data")


def write_shard(path: Path, shard: ShardPlan, entries: dict[str, Entry], tw: TensorWriter, *, fsync: bool,
                progress: ProgressFn | None = None, grand: list[int] | None = None,
                keep_fd: bool = False) -> int | None:
    """One whole shard: header, then every tensor in file order, then fsync. With ``keep_fd`` it
    returns a duplicate of the writing descriptor (same open file description, so an fsync on it
    sees every writeback error of these writes) for the caller to fsync and close."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _pwrite_all(fd, shard.header, 0)
        base = len(shard.header)
        for info in shard.layout:
            tw.write(fd, base + info.begin, entries[info.name], info.nbytes)
            if grand is not None:
                grand[0] += info.nbytes
                if progress:
                    progress(ProgressEvent("write", shard.name, grand[0], grand[1]))
        if os.fstat(fd).st_size != shard.file_size:
            raise InputError(f"{shard.name}: wrote {os.fstat(fd).st_size} bytes, planned {shard.file_size}",
                             "the source changed while it was read")
        _faults.point("fsync-shard")
        if fsync:
            os.fsync(fd)
        return os.dup(fd) if keep_fd else None
    finally:
        os.close(fd)


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _chunks_from(e: Entry, skip: int, chunk_bytes: int) -> Iterable[Any]:
    """The entry's stored bytes, starting ``skip`` bytes in (only when not converting)."""
    target = e.dtype if e.dtype != e.tensor.dtype else None
    if skip == 0:
        yield from e.source.chunks(e.tensor, target, chunk_bytes)
        return
    assert target is None
    seen = 0
    for chunk in e.source.chunks(e.tensor, None, chunk_bytes):
        view = memoryview(chunk).cast("B")
        if seen + len(view) <= skip:
            seen += len(view)
            continue
        start = max(0, skip - seen)
        seen += len(view)
        yield view[start:]


# ----------------------------------------------------------------------------------------------
# The whole export


class ExportJob:
    """One export, in steps: :meth:`prepare` (plan, checks; all a dry run does), :meth:`stage`,
    writing the shards, :meth:`finalize` (index, extras, carried files, manifest, fsync) and
    :meth:`publish`. :func:`write_checkpoint` runs them in one process; the multi-rank writer in
    ``ckptctl.distributed`` runs them across ranks."""

    def __init__(self, entries: list[Entry], dest: str | os.PathLike[str], opts: ExportOptions, *,
                 extras: dict[str, Path | bytes] | None = None, aliases: dict[str, str] | None = None,
                 adapter: bool = False, plan: Plan | None = None) -> None:
        self.started = time.monotonic()
        self.entries = entries
        self.dest = Path(os.path.abspath(dest))
        self.opts = opts
        self.adapter = adapter
        self._extras_in = extras or {}
        self.result = ExportResult(dest=str(self.dest), dry_run=opts.dry_run, aliases=dict(aliases or {}))
        self.by_name: dict[str, Entry] = {}
        self.plan: Plan | None = plan
        self.extra_blobs: dict[str, bytes] = {}
        self.stage_: Stage | None = None
        self.dest_existed = False

    def prepare(self, *, recover: bool = True) -> ExportResult:
        """Validate, plan from metadata, decide what the old version loses and keeps.

        First (unless a dry run, or ``recover=False`` on ranks that are not the leader) finish any
        half-done publish a dead writer left for this destination, so what is kept is decided
        from the destination as it really is."""
        opts, result, dest = self.opts, self.result, self.dest
        if recover and not opts.dry_run:
            result.recovered = recover_destination(dest)
        if not self.entries:
            raise InputError("there are no tensors to write", "check the source: it holds no weights")
        try:
            max_shard = parse_size(opts.max_shard_size)
        except ValueError as exc:
            raise UsageError(str(exc), "use a size like 5GB, 500MB or 2GiB") from None
        for e in self.entries:
            if e.tensor.name in self.by_name:
                raise InputError(f"tensor {e.tensor.name!r} is given twice", "tensor names must be unique")
            self.by_name[e.tensor.name] = e
        if self.plan is None:
            try:
                self.plan = make_plan([e.spec for e in self.entries], max_shard_size=max_shard, prefix=opts.prefix,
                                      metadata=opts.metadata, aliases=result.aliases,
                                      single_file=opts.single_file or self.adapter)
            except ValueError as exc:
                raise InputError(str(exc), "check the tensor names and --max-shard-size") from None
        plan = self.plan
        exists = check_destination(dest, overwrite=opts.overwrite)
        self.dest_existed = exists
        removed, carried = superseded(dest, adapter=self.adapter) if exists else ([], [])
        self.extra_blobs = _resolve_extras(self._extras_in, self.entries)
        result.index = plan.index_name
        result.tensors = len(self.entries)
        result.parameters = plan.total_parameters
        result.total_size = plan.total_size
        result.bytes_to_write = plan.bytes_to_write + sum(len(b) for b in self.extra_blobs.values())
        result.files = [{"name": s.name, "size": s.file_size, "tensors": len(s.specs),
                         "linked_from": s.link_from} for s in plan.shards]
        result.linked = [s.name for s in plan.shards if s.link_from]
        result.extras = sorted(self.extra_blobs)
        result.carried = [n for n in carried if n not in self.extra_blobs]
        # the old version's files that the new one does not replace by name
        result.removed = sorted((set(removed) | {n for n in carried if n in self.extra_blobs})
                                - set(plan.files) - set(self.extra_blobs))
        result.converted = sum(1 for e in self.entries if e.dtype != e.tensor.dtype)
        result.manifest = MANIFEST_NAME if opts.manifest else None
        probe = dest.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            result.space_available = free_space(probe)
        except OSError:
            result.space_available = None
        if opts.progress:
            opts.progress(ProgressEvent("plan", total=plan.total_size))
        return result

    def stage(self) -> Path:
        """Check space, recover a dead writer's half-done publish, create the staging directory."""
        assert self.plan is not None
        dest = self.dest
        if not dest.parent.is_dir():
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise from_oserror(exc, "cannot create the destination's parent", phase="plan") from None
        check_writable(dest.parent)
        avail = free_space(dest.parent)
        need = self.result.bytes_to_write + BLOCK_MARGIN * (len(self.plan.files) + len(self.extra_blobs) + 4)
        if avail < need:
            raise DiskFullError(
                f"not enough free space in {dest.parent}: need {self.result.bytes_to_write:,} bytes, "
                f"{avail:,} available", "free space or write elsewhere; nothing was written", phase="plan")
        self.stage_ = Stage(dest, fsync=self.opts.fsync, command=self.opts.command)
        data = self.stage_.create()
        self.stage_.check_competitors()
        return data

    def write_shards(self, data: Path) -> None:
        """Write (or link) every shard. Each written shard is fsynced on a background thread while
        the next one is written; every fsync has finished (and any error raised) on return."""
        from concurrent.futures import ThreadPoolExecutor

        assert self.plan is not None
        tw = TensorWriter(self.opts.chunk_bytes, self.result)
        progress = self.opts.progress
        grand = [0, self.plan.total_size]
        syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-fsync")
        pending = []
        try:
            for shard in self.plan.shards:
                _faults.point("shard-start")
                path = data / shard.name
                try:
                    if shard.link_from:
                        _link_or_copy(Path(shard.link_from), path, fsync=self.opts.fsync)
                        grand[0] += shard.data_bytes
                    else:
                        fd = write_shard(path, shard, self.by_name, tw, fsync=False, progress=progress,
                                         grand=grand, keep_fd=self.opts.fsync)
                        if fd is not None:
                            pending.append((shard.name, syncer.submit(_fsync_and_close, fd)))
                except OSError as exc:
                    raise from_oserror(exc, f"cannot write {shard.name}", phase="write") from None
                if progress:
                    progress(ProgressEvent("shard-done", shard.name, grand[0], grand[1],
                                           message="linked" if shard.link_from else "wrote"))
            for name, fut in pending:
                try:
                    fut.result()  # never retried: a failed fsync aborts the publish
                except OSError as exc:
                    raise from_oserror(exc, f"cannot make {name} durable", phase="write") from None
        finally:
            syncer.shutdown(wait=True)
            tw.close()
        _faults.point("shards-written")

    def finalize(self) -> None:
        """Index, extras, the old version's kept files, manifest; then fsync and mark ready."""
        assert self.plan is not None and self.stage_ is not None
        plan, opts, stage, data = self.plan, self.opts, self.stage_, self.stage_.data
        if opts.progress:
            opts.progress(ProgressEvent("finalize"))
        try:
            if plan.index_name:
                _faults.point("index")
                meta = dict(opts.metadata or {})
                meta.update({k: v for k, v in plan.aliases.items() if k not in meta})
                stage.write_file(plan.index_name, encode_index(plan.weight_map, plan.total_size,
                                                               total_parameters=plan.total_parameters,
                                                               extra_metadata=meta))
            for name, blob in sorted(self.extra_blobs.items()):
                stage.write_file(name, blob)
            for name in self.result.carried:
                _link_or_copy(self.dest / name, data / name, fsync=opts.fsync)
            _faults.point("extras-written")
            if opts.manifest:
                doc = build_manifest(data, _walk_files(data), label=opts.label)
                stage.write_file(MANIFEST_NAME, encode_manifest(doc))
            _faults.point("manifest-written")
        except OSError as exc:
            raise from_oserror(exc, "cannot write the index and extras", phase="finalize") from None
        stage.seal()
        stage.check_competitors()

    def publish(self) -> ExportResult:
        assert self.stage_ is not None and self.plan is not None
        if self.opts.progress:
            self.opts.progress(ProgressEvent("publish"))
        self.result.publish = self.stage_.publish(replace=self.dest_existed)
        _faults.point("after-publish")
        self.stage_.finish()
        self.result.seconds = time.monotonic() - self.started
        if self.opts.progress:
            self.opts.progress(ProgressEvent("done", done=self.plan.total_size, total=self.plan.total_size))
        return self.result

    def abort(self) -> None:
        if self.stage_ is not None:
            self.stage_.abort()


def write_checkpoint(entries: list[Entry], dest: str | os.PathLike[str], opts: ExportOptions, *,
                     extras: dict[str, Path | bytes] | None = None, aliases: dict[str, str] | None = None,
                     adapter: bool = False, plan: Plan | None = None) -> ExportResult:
    """Write ``entries`` as a safetensors checkpoint and publish it at ``dest`` atomically.

    ``extras`` maps file names to a source path or bytes (config.json, tokenizer files, ...).
    """
    job = ExportJob(entries, dest, opts, extras=extras, aliases=aliases, adapter=adapter, plan=plan)
    result = job.prepare()
    if opts.dry_run:
        result.seconds = time.monotonic() - job.started
        return result
    phase = "stage"
    try:
        data = job.stage()
        phase = "write"
        job.write_shards(data)
        phase = "finalize"
        job.finalize()
        phase = "publish"
        return job.publish()
    except BaseException as exc:
        published = job.stage_ is not None and job.stage_.published
        job.abort()
        if isinstance(exc, KeyboardInterrupt) and published:
            raise Interrupted(f"interrupted after publishing: {job.dest} holds the new version",
                              "nothing to redo; `ckptctl gc-tmp` removes anything left behind",
                              phase="cleanup") from None
        if isinstance(exc, CkptctlError) and exc.phase is None:
            exc.phase = phase
        raise


def _walk_files(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def _resolve_extras(extras: dict[str, Path | bytes], entries: list[Entry]) -> dict[str, bytes]:
    """Read the extras into bytes (they are small), syncing config.json's dtype."""
    out: dict[str, bytes] = {}
    stored = _dominant_float(entries)
    for name, src in extras.items():
        if "/" in name or name in ("", ".", ".."):
            raise InputError(f"extra file name {name!r} is not a plain file name", "pass plain names")
        if isinstance(src, (bytes, bytearray)):
            blob = bytes(src)
        else:
            try:
                blob = Path(src).read_bytes()
            except OSError as exc:
                raise from_oserror(exc, f"cannot read {name}", phase="plan") from None
        if name == "config.json" and stored and any(e.dtype != e.tensor.dtype for e in entries):
            blob = _sync_config_dtype(blob, stored)
        out[name] = blob
    return out


def _dominant_float(entries: list[Entry]) -> str | None:
    counts: dict[str, int] = {}
    for e in entries:
        if e.dtype in dt.CONVERTIBLE:
            counts[e.dtype] = counts.get(e.dtype, 0) + e.tensor.numel
    return max(counts, key=lambda k: counts[k]) if counts else None

