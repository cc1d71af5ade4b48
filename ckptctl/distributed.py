"""Multi-rank writing on torch.distributed.

Every rank contributes tensors; the ranks agree on one global shard plan through a collective
(names and order do not depend on the rank count), then run the publish protocol's phases:

1. ``plan``     all_gather of every rank's tensor metadata; each rank computes the same plan.
2. ``prepare``  the leader (rank 0, or for node-local storage the local rank 0 of every node)
                creates the staging directory and every shard file (header written, data area
                allocated); the staging path is shared with the other ranks.
3. ``write``    every rank writes its tensors' bytes at their planned offsets (kernel copy for
                unchanged safetensors ranges) and fsyncs what it wrote.
4. ``exchange`` all_gather of what each rank wrote; the leader checks it against the plan.
5. ``publish``  the leader writes index, extras, manifest and fsyncs; every rank votes.
6. ``commit``   only if every rank is ready, the leader publishes; the outcome is agreed across
                ranks (for node-local storage a node whose publish fails is named in the error,
                while the other nodes keep their complete new version).

Each phase is exception-robust in the way torch DCP's ``_DistWrapper`` is: a rank's exception is
caught, every rank's outcome is all-gathered over a Gloo group (with a timeout), and if any rank
failed every rank raises the same :class:`DistributedWriteError` naming each failed rank, its
phase and its message. Nothing is published and the leader removes the staging directory once
every rank has left the phase. A rank that dies makes the collective fail for the others within
the group's timeout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

from ckptctl import _faults
from ckptctl.errors import CkptctlError, InputError, OperationalError
from ckptctl.sources.base import Source, SourceTensor
from ckptctl.writer import Entry, ExportJob, ExportOptions, ExportResult, TensorWriter, entries_for

SHARED = "shared"
NODE_LOCAL = "node-local"
DEFAULT_TIMEOUT = 300.0


class DistributedWriteError(OperationalError):
    """Raised on every rank when any rank failed a phase of a multi-rank write."""

    code = "distributed"

    def __init__(self, phase: str, failures: dict[int, str]) -> None:
        parts = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        super().__init__(f"multi-rank write failed in phase {phase}: {parts}",
                         "fix the failing rank's problem and run again; nothing was published", phase=phase)
        self.failures = failures


class _Remote(Source):
    """Stands for tensors another rank writes (metadata only)."""

    def chunks(self, t: SourceTensor, target_dtype: str | None = None, chunk_bytes: int = 0):
        raise AssertionError("remote tensors are written by their owner")


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass
class _Ctx:
    dist: Any
    group: Any
    rank: int
    world: int
    node: int
    node_ranks: list[int]  # global ranks of this rank's node (all ranks for shared storage)
    leader: int  # global rank that stages and publishes for this rank
    owns_group: bool = False  # we created the Gloo group: destroy it when done

    def close(self) -> None:
        if self.owns_group:
            try:
                self.dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - a group broken by a dead peer cannot be torn down cleanly
                pass

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def _context(group: Any, storage: str, node_rank: int | None, timeout: float) -> _Ctx:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InputError("torch.distributed is not initialized",
                         "call torch.distributed.init_process_group first (or run under torchrun)")
    owned = group is None
    if owned:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if storage not in (SHARED, NODE_LOCAL):
        raise InputError(f"unknown storage scope {storage!r}", "use 'shared' or 'node-local'")
    if storage == SHARED:
        return _Ctx(dist, group, rank, world, 0, list(range(world)), 0, owned)
    if node_rank is None:
        if "GROUP_RANK" in os.environ:
            node_rank = int(os.environ["GROUP_RANK"])
        else:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            node_rank = rank // max(1, local_world)
    nodes = [None] * world
    dist.all_gather_object(nodes, node_rank, group=group)
    mine = [r for r, n in enumerate(nodes) if n == node_rank]
    return _Ctx(dist, group, rank, world, node_rank, mine, min(mine), owned)


def _phase(ctx: _Ctx, name: str, fn: Callable[[], Any], on_failure: Callable[[], None] | None = None) -> list[Any]:
    """Run ``fn`` on this rank; gather every rank's outcome; raise the same error everywhere."""
    value: Any = None
    error: str | None = None
    try:
        _faults.point(f"dist-{name}")
        value = fn()
    except CkptctlError as exc:
        error = str(exc.message)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KeyboardInterrupt):
            error = "interrupted"
    outcomes: list[Any] = [None] * ctx.world
    try:
        ctx.dist.all_gather_object(outcomes, (error, value), group=ctx.group)
    except Exception as exc:  # noqa: BLE001 - a dead or hung peer
        if on_failure:
            on_failure()
        failures = {ctx.rank: error} if error else {}
        failures.setdefault(-1, f"collective failed (a rank died or timed out): {str(exc).splitlines()[0][:200]}")
        raise DistributedWriteError(name, {k: v for k, v in failures.items()}) from None
    failed = {r: o[0] for r, o in enumerate(outcomes) if o[0] is not None}
    if failed:
        if on_failure:
            on_failure()
        raise DistributedWriteError(name, failed)
    return [o[1] for o in outcomes]


def _meta(e: Entry) -> tuple[str, str, tuple[int, ...], str]:
    return (e.tensor.name, e.tensor.dtype, tuple(e.tensor.shape), e.dtype)


def write_distributed(local: list[Entry], dest: str | os.PathLike[str], opts: ExportOptions, *,
                      group: Any = None, storage: str = SHARED, node_rank: int | None = None,
                      timeout: float = DEFAULT_TIMEOUT, order: list[str] | None = None,
                      split_shards: bool = False, extras: dict[str, Path | bytes] | None = None,
                      aliases: dict[str, str] | None = None) -> ExportResult:
    """The multi-rank protocol (see module docstring). Collective: every rank must call it.

    ``local`` are the tensors this rank holds. With ``split_shards`` every rank holds every
    tensor and the shards are divided among the writers round-robin; otherwise a tensor is
    written by the lowest rank that holds it. ``order`` fixes the tensor order of the plan
    (default: natural sort of the names, so the plan does not depend on the rank count).
    ``extras`` and ``opts.manifest`` are taken from the leader.
    """
    ctx = _context(group, storage, node_rank, timeout)
    try:
        return _write(ctx, local, dest, opts, storage=storage, order=order, split_shards=split_shards,
                      extras=extras, aliases=aliases)
    finally:
        ctx.close()


def _write(ctx: _Ctx, local: list[Entry], dest: str | os.PathLike[str], opts: ExportOptions, *, storage: str,
           order: list[str] | None, split_shards: bool, extras: dict[str, Path | bytes] | None,
           aliases: dict[str, str] | None) -> ExportResult:
    opts = replace(opts, progress=opts.progress if ctx.rank == 0 else None)

    # 1. plan ------------------------------------------------------------------------------
    gathered = _phase(ctx, "plan", lambda: ([_meta(e) for e in local], dict(aliases or {})))
    metas: dict[str, tuple] = {}
    owner: dict[str, int] = {}
    conflicts = []
    all_aliases: dict[str, str] = {}
    for r in ctx.node_ranks:
        rank_metas, rank_aliases = gathered[r]
        all_aliases.update(rank_aliases)
        for m in rank_metas:
            if m[0] in metas and metas[m[0]] != m:
                conflicts.append(f"{m[0]!r}: rank {owner[m[0]]} has {metas[m[0]][1:]} , rank {r} has {m[1:]}")
            metas.setdefault(m[0], m)
            owner.setdefault(m[0], r)
    if storage == NODE_LOCAL:
        # every node must hold the same tensor set
        everyone: dict[str, tuple] = {}
        for rank_metas, _a in gathered:
            for m in rank_metas:
                everyone.setdefault(m[0], m)
        missing = sorted(set(everyone) - set(metas))
        if missing:
            conflicts.append(f"node {ctx.node} lacks {len(missing)} tensors held elsewhere (e.g. {missing[0]!r})")
    names = list(order) if order is not None else sorted(metas, key=_natural_key)
    if set(names) != set(metas):
        conflicts.append("the given order does not name exactly the tensors the ranks hold")
    local_by_name = {e.tensor.name: e for e in local}
    entries = []
    for n in names:
        if n in local_by_name:
            entries.append(local_by_name[n])
        elif n in metas:
            name, dtype, shape, stored = metas[n]
            entries.append(Entry(_Remote(path=Path("."), kind="remote"), SourceTensor(name, dtype, shape), stored))

    job = ExportJob(entries, dest, opts, extras=extras if ctx.is_leader else None, aliases=all_aliases)

    def prepare() -> str | None:
        if conflicts:
            raise InputError("ranks disagree on the tensors: " + "; ".join(conflicts[:3]),
                             "every tensor name must have one dtype and shape on all ranks")
        job.prepare(recover=ctx.is_leader)
        if opts.dry_run or not ctx.is_leader:
            return None
        data = job.stage()
        for shard in job.plan.shards:
            fd = os.open(data / shard.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.pwrite(fd, shard.header, 0)
                os.ftruncate(fd, shard.file_size)
            finally:
                os.close(fd)
        return str(data)

    # 2. prepare ---------------------------------------------------------------------------
    staged = _phase(ctx, "prepare", prepare, on_failure=job.abort)
    if opts.dry_run:
        return job.result
    data = Path(staged[ctx.leader])
    plan = job.plan
    assert plan is not None

    # who writes what
    mine: list[tuple[str, int, Any]] = []  # (shard name, file offset, TensorInfo)
    writers = ctx.node_ranks
    for i, shard in enumerate(plan.shards):
        base = len(shard.header)
        for info in shard.layout:
            w = writers[i % len(writers)] if split_shards else owner[info.name]
            if w == ctx.rank:
                mine.append((shard.name, base + info.begin, info))

    def write() -> dict[str, int]:
        tw = TensorWriter(opts.chunk_bytes, job.result)
        written: dict[str, int] = {}
        fds: dict[str, int] = {}
        try:
            for shard_name, pos, info in mine:
                if shard_name not in fds:
                    fds[shard_name] = os.open(data / shard_name, os.O_WRONLY | os.O_CLOEXEC)
                tw.write(fds[shard_name], pos, local_by_name[info.name], info.nbytes)
                written[shard_name] = written.get(shard_name, 0) + info.nbytes
            _faults.point("fsync-shard")
            if opts.fsync:
                for fd in fds.values():
                    os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
            tw.close()
        return written

    # 3. write -----------------------------------------------------------------------------
    written = _phase(ctx, "write", write, on_failure=job.abort)

    # 4. exchange --------------------------------------------------------------------------
    def exchange() -> None:
        if not ctx.is_leader:
            return
        totals: dict[str, int] = {}
        for r in ctx.node_ranks:
            for name, n in written[r].items():
                totals[name] = totals.get(name, 0) + n
        for shard in plan.shards:
            if totals.get(shard.name, 0) != shard.data_bytes:
                raise OperationalError(f"{shard.name}: ranks wrote {totals.get(shard.name, 0)} of "
                                       f"{shard.data_bytes} data bytes", "a rank skipped tensors it holds")
            if (data / shard.name).stat().st_size != shard.file_size:
                raise OperationalError(f"{shard.name} has the wrong size", "the storage lost a write")

    _phase(ctx, "exchange", exchange, on_failure=job.abort)

    # 5. publish: every rank votes (the leader by finalizing: index, extras, manifest, fsync);
    #    only when all are ready does the leader publish, and the outcome is agreed once more.
    def finalize() -> None:
        if ctx.is_leader:
            job.finalize()

    _phase(ctx, "publish", finalize, on_failure=job.abort)

    def commit() -> dict[str, Any] | None:
        if not ctx.is_leader:
            return None
        try:
            job.publish()
        except BaseException:
            job.abort()
            raise
        return job.result.to_dict()

    results = _phase(ctx, "commit", commit, on_failure=job.abort)
    leader_result = results[ctx.leader]
    result = ExportResult(**{k: v for k, v in leader_result.items()})
    result.bytes_copied_by_kernel = sum(r["bytes_copied_by_kernel"] for r in results if r)
    return result


def save_state_dict_distributed(state_dict: Mapping[str, Any], dest: str | os.PathLike[str], *,
                                group: Any = None, storage: str = SHARED, node_rank: int | None = None,
                                timeout: float = DEFAULT_TIMEOUT,
                                extras: Mapping[str, bytes | os.PathLike[str]] | None = None,
                                **options: Any) -> ExportResult:
    """Collective: each rank passes the tensors it holds (replicated names are written once)."""
    from ckptctl.sources.torch_source import TorchSource

    opts = ExportOptions(**options)
    src = TorchSource.from_state_dict(state_dict, path=Path(dest))
    local = entries_for(src, opts.dtype)
    ex = {k: (v if isinstance(v, bytes) else Path(v)) for k, v in (extras or {}).items()}
    return write_distributed(local, dest, opts, group=group, storage=storage, node_rank=node_rank,
                             timeout=timeout, extras=ex, aliases=src.aliases)


def export_distributed(src: str | os.PathLike[str], dst: str | os.PathLike[str], opts: ExportOptions, *,
                       key: str | None = None, only: str | None = None, group: Any = None,
                       storage: str = SHARED, timeout: float = DEFAULT_TIMEOUT) -> ExportResult:
    """``export`` under torchrun: every rank opens the source, ranks split the shards, rank 0
    publishes. The output is byte-identical to a single-process export of the same source."""
    from ckptctl.api import prepare_export

    with prepare_export(src, dst, opts, key=key, only=only) as (source, entries, opts2, extras, adapter):
        return write_distributed(entries, dst, opts2, group=group, storage=storage, timeout=timeout,
                                 order=[e.tensor.name for e in entries], split_shards=True, extras=extras,
                                 aliases=source.aliases)
