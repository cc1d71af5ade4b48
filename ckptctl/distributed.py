"""Multi-rank writing on torch.distributed.

Every rank contributes tensors; the ranks agree on one global shard plan (names and order do not
depend on the rank count) and run the single-process writer's steps (``ckptctl.write.job``),
under the same phase names:

0. ``join``     every rank marks its arrival in the process group's store and waits (at most
                ``timeout`` seconds) for the others: a rank that never calls the writer is named.
1. ``plan``     all_gather of every rank's tensor metadata; then every rank runs the job's plan
                step on the same global tensor list (the leader also recovers a dead writer's
                half-done publish of the destination).
2. ``stage``    the leader (rank 0, or for node-local storage the local rank 0 of every node)
                creates the staging directory and every shard file with the job's own
                allocation (header written, data area allocated); the staging path is shared.
3. ``write``    every rank writes its tensors' bytes at their planned offsets (kernel copy for
                unchanged safetensors ranges) and fsyncs what it wrote.
4. ``finalize`` the leader checks what the ranks wrote against the plan, then writes index,
                extras, manifest and seals the directory; every rank votes.
5. ``publish``  only if every rank is ready, the leader publishes; the outcome is agreed across
                ranks (for node-local storage a node whose publish fails is named in the error,
                while the other nodes keep their complete new version).

Each phase is exception-robust in the way torch DCP's ``_DistWrapper`` is: a rank's exception is
caught, every rank's outcome is all-gathered over a Gloo group, and if any rank failed every rank
raises the same :class:`DistributedWriteError` naming each failed rank, its phase and its message.
Nothing is published and the leader removes the staging directory. An error after the leader's
publish says so (the destination holds the new version). Every exchange waits at most
``timeout`` seconds: a rank that died or hangs is named (the ranks that did not reach the end of
the phase, read from the store) within it.

A signal (Ctrl-C, or SIGTERM/SIGHUP where the program handles them like Ctrl-C, as the CLI does)
is handled at once, even while this rank waits for the others: the rank leaves the protocol, the
leader removes the staging directory, and :class:`DistributedInterrupted` (exit 130, or 128 + the
signal) is raised. The transport (joining, the exchanges, the signals, the errors) is
:mod:`ckptctl.dist_exchange`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

from ckptctl import _faults
from ckptctl.dist_exchange import (COLLECTIVE_ERRORS, DEFAULT_TIMEOUT, LATE, Ctx, DistributedInterrupted,
                                   DistributedWriteError, Exchange, Signals, cause_of, default_store, init_from_env,
                                   join, run_prefix, signal_name)
from ckptctl.errors import InputError, OperationalError
from ckptctl.format.tensor import TensorSpec
from ckptctl.plan import Plan
from ckptctl.sources.base import Source, SourceTensor
from ckptctl.write.inputs import Entry, ExportInputs, open_inputs, state_dict_inputs
from ckptctl.write.job import ExportJob, ExportResult
from ckptctl.write.options import ExportOptions
from ckptctl.write.shards import TensorWriter, create_shard, write_into

__all__ = ["DEFAULT_TIMEOUT", "NODE_LOCAL", "SHARED", "DistributedInterrupted", "DistributedWriteError",
           "export_distributed", "init_from_env", "save_state_dict_distributed", "write_distributed"]

SHARED = "shared"
NODE_LOCAL = "node-local"


class _Remote(Source):
    """Stands for tensors another rank writes (metadata only)."""

    def chunks(self, t: SourceTensor, target_dtype: str | None = None, chunk_bytes: int = 0):
        raise AssertionError("remote tensors are written by their owner")


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _context(group: Any, storage: str, node_rank: int | None, timeout: float, signals: Signals) -> Ctx:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InputError("torch.distributed is not initialized",
                         "call torch.distributed.init_process_group first (or run under torchrun)")
    if storage not in (SHARED, NODE_LOCAL):
        raise InputError(f"unknown storage scope {storage!r}", "use 'shared' or 'node-local'")
    if not timeout > 0:
        raise InputError(f"timeout must be a positive number of seconds, not {timeout!r}", "e.g. timeout=300")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = default_store()
    prefix = run_prefix(store, rank) if store is not None else ""
    if store is not None:
        join(store, f"{prefix}/join", rank, world, timeout)
    owned = group is None
    if owned:
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except COLLECTIVE_ERRORS as exc:
            raise DistributedWriteError("join", {-1: f"the Gloo group could not be formed: {cause_of(exc)}"},
                                        hint=LATE) from None
    ctx = Ctx(dist, group, rank, world, 0, list(range(world)), 0, timeout, owned, store, prefix)
    if storage == SHARED:
        return ctx
    if node_rank is None:
        if "GROUP_RANK" in os.environ:
            node_rank = int(os.environ["GROUP_RANK"])
        else:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            node_rank = rank // max(1, local_world)
    nodes = Exchange(replace(ctx, prefix=f"{prefix}/nodes"), signals).gather("join", node_rank)
    mine = [r for r, n in enumerate(nodes) if n == node_rank]
    return replace(ctx, node=node_rank, node_ranks=mine, leader=min(mine))


@dataclass
class _Merged:
    """The global tensor list as this rank sees it after the metadata exchange."""

    entries: list[Entry]  # plan order; this rank's own entries where it holds the tensor
    owner: dict[str, int]  # the lowest rank of this node holding each tensor
    aliases: dict[str, str]
    conflicts: list[str]


def _merge(ctx: Ctx, gathered: list[Any], local: list[Entry], storage: str, order: list[str] | None) -> _Merged:
    """Every rank's ``(source spec, stored spec)`` lists, merged into one tensor list."""
    metas: dict[str, tuple[TensorSpec, TensorSpec]] = {}
    owner: dict[str, int] = {}
    conflicts: list[str] = []
    aliases: dict[str, str] = {}
    for r in ctx.node_ranks:
        rank_metas, rank_aliases = gathered[r]
        aliases.update(rank_aliases)
        for m in rank_metas:
            name = m[0].name
            if name in metas and metas[name] != m:
                conflicts.append(f"{name!r}: rank {owner[name]} has {metas[name]}, rank {r} has {m}")
            metas.setdefault(name, m)
            owner.setdefault(name, r)
    if storage == NODE_LOCAL:  # every node must hold the same tensor set
        everyone = {m[0].name for rank_metas, _a in gathered for m in rank_metas}
        missing = sorted(everyone - set(metas))
        if missing:
            conflicts.append(f"node {ctx.node} lacks {len(missing)} tensors held elsewhere (e.g. {missing[0]!r})")
    names = list(order) if order is not None else sorted(metas, key=_natural_key)
    if set(names) != set(metas):
        conflicts.append("the given order does not name exactly the tensors the ranks hold")
    mine = {e.name: e for e in local}
    remote = _Remote(path=Path("."), kind="remote")
    entries = [mine.get(n) or Entry(metas[n][1], remote, SourceTensor(metas[n][0])) for n in names if n in metas]
    return _Merged(entries, owner, aliases, conflicts)


def write_distributed(inputs: ExportInputs, dest: str | os.PathLike[str], *, group: Any = None,
                      storage: str = SHARED, node_rank: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                      order: list[str] | None = None, split_shards: bool = False) -> ExportResult:
    """The multi-rank protocol (see module docstring). Collective: every rank must call it.

    ``inputs.entries`` are the tensors this rank holds. With ``split_shards`` every rank holds
    every tensor and the shards are divided among the writers round-robin; otherwise a tensor is
    written by the lowest rank that holds it. ``order`` fixes the tensor order of the plan
    (default: natural sort of the names, so the plan does not depend on the rank count).
    Extras and ``options.manifest`` are taken from the leader. ``timeout``: the seconds a rank
    waits for the others when joining and at each phase's exchange; the ranks that did not come
    are named in the :class:`DistributedWriteError`.
    """
    with Signals() as signals:
        try:
            ctx = _context(group, storage, node_rank, timeout, signals)
        except KeyboardInterrupt:
            raise DistributedInterrupted(f"multi-rank write interrupted by {signal_name(signals.signum)} while "
                                         "the ranks joined; nothing was staged", "run the command again to start over",
                                         phase="join", signum=signals.signum) from None
        ex = Exchange(ctx, signals)
        try:
            return _write(ex, inputs, dest, storage=storage, order=order, split_shards=split_shards)
        except KeyboardInterrupt:
            raise ex.interrupted() from None
        except BaseException:
            ex.abort()
            raise
        finally:
            ctx.close()


def _write(ex: Exchange, inputs: ExportInputs, dest: str | os.PathLike[str], *, storage: str,
           order: list[str] | None, split_shards: bool) -> ExportResult:
    ctx = ex.ctx
    opts = replace(inputs.options, progress=inputs.options.progress if ctx.rank == 0 else None)

    # plan: the metadata exchange, then the job's plan step on the global tensor list
    gathered = ex.phase("plan", lambda: ([(e.tensor.spec, e.spec) for e in inputs.entries], inputs.aliases))
    merged = _merge(ctx, gathered, inputs.entries, storage, order)
    job = ex.job = ExportJob(replace(inputs, entries=merged.entries, options=opts, aliases=merged.aliases,
                                     extras=inputs.extras if ctx.is_leader else {}), dest)

    def plan() -> None:
        if merged.conflicts:
            raise InputError("ranks disagree on the tensors: " + "; ".join(merged.conflicts[:3]),
                             "every tensor name must have one dtype and shape on all ranks")
        job.prepare(recover=ctx.is_leader)

    ex.phase("plan", plan)
    if opts.dry_run:
        return job.result
    planned = job.plan
    assert planned is not None

    def stage() -> str | None:
        if not ctx.is_leader:
            return None
        data = job.stage()
        for shard in planned.shards:
            os.close(create_shard(data / shard.name, shard))
        return str(data)

    data = Path(ex.phase("stage", stage)[ctx.leader])
    writers = ctx.node_ranks

    def writes_here(i: int, name: str) -> bool:
        w = writers[i % len(writers)] if split_shards else merged.owner[name]
        return w == ctx.rank

    def write() -> tuple[dict[str, int], int, int]:
        tw = TensorWriter(opts.chunk_bytes, writeback=opts.fsync)
        written: dict[str, int] = {}
        try:
            for i, shard in enumerate(planned.shards):
                mine = {info.name for info in shard.layout if writes_here(i, info.name)}
                if not mine:
                    continue
                fd = os.open(data / shard.name, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    written[shard.name] = write_into(fd, shard, job.by_name, tw, only=mine)
                    _faults.point("fsync-shard")
                    if opts.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            tw.close()
        return written, tw.copied, tw.streamed

    written = ex.phase("write", write)

    def finalize() -> None:
        if ctx.is_leader:
            _check_written(planned, data, [written[r][0] for r in ctx.node_ranks])
            job.finalize()

    ex.phase("finalize", finalize)

    def publish() -> dict[str, Any] | None:
        if not ctx.is_leader:
            return None
        try:
            job.publish()
        except BaseException:
            ex.abort()
            raise
        return job.result.to_dict()

    results = ex.phase("publish", publish)
    result = ExportResult(**results[ctx.leader])
    result.bytes_copied_by_kernel = sum(written[r][1] for r in ctx.node_ranks)
    result.bytes_streamed = sum(written[r][2] for r in ctx.node_ranks)
    return result


def _check_written(plan: Plan, data: Path, per_rank: list[dict[str, int]]) -> None:
    """Every shard's data bytes were written by some rank, and its file has the planned size."""
    totals: dict[str, int] = {}
    for written in per_rank:
        for name, n in written.items():
            totals[name] = totals.get(name, 0) + n
    for shard in plan.shards:
        if totals.get(shard.name, 0) != shard.data_bytes:
            raise OperationalError(f"{shard.name}: ranks wrote {totals.get(shard.name, 0)} of "
                                   f"{shard.data_bytes} data bytes", "a rank skipped tensors it holds")
        if (data / shard.name).stat().st_size != shard.file_size:
            raise OperationalError(f"{shard.name} has the wrong size", "the storage lost a write")


def save_state_dict_distributed(state_dict: Mapping[str, Any], dest: str | os.PathLike[str], *,
                                group: Any = None, storage: str = SHARED, node_rank: int | None = None,
                                timeout: float = DEFAULT_TIMEOUT,
                                extras: Mapping[str, bytes | os.PathLike[str]] | None = None,
                                **options: Any) -> ExportResult:
    """Collective: each rank passes the tensors it holds (replicated names are written once)."""
    with state_dict_inputs(state_dict, dest, ExportOptions(**options), extras=extras) as inputs:
        return write_distributed(inputs, dest, group=group, storage=storage, node_rank=node_rank, timeout=timeout)


def export_distributed(src: str | os.PathLike[str], dst: str | os.PathLike[str], opts: ExportOptions, *,
                       key: str | None = None, only: str | None = None, group: Any = None,
                       storage: str = SHARED, timeout: float = DEFAULT_TIMEOUT) -> ExportResult:
    """``export`` under torchrun: every rank opens the source, ranks split the shards, rank 0
    publishes. The output is byte-identical to a single-process export of the same source."""
    with open_inputs(src, dst, opts, key=key, only=only) as inputs:
        return write_distributed(inputs, dest=dst, group=group, storage=storage, timeout=timeout,
                                 order=[e.name for e in inputs.entries], split_shards=True)
