"""The transport of the multi-rank writer (:mod:`ckptctl.distributed`): joining, the
exchanges of every phase's outcome, the signals, and the errors every rank raises.

Every exchange is an all_gather over a Gloo group, started asynchronously and waited for in short
sleeps, so that a signal (Ctrl-C, or SIGTERM/SIGHUP where the program handles them like Ctrl-C, as
the CLI does) is handled at once even while this rank waits for the others. Before each exchange a
rank marks its arrival in the process group's store, so a rank that died or hangs is named. A
rank that left an exchange unfinished leaves Gloo work pending: torch waits for it (until the
group's timeout) when the process exits, so the CLI ends such a process with ``os._exit`` after
its cleanup and its error line.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ckptctl import _faults
from ckptctl.errors import EXIT_INTERRUPTED, EXIT_SIGNAL_BASE, CkptctlError, Interrupted, OperationalError

if TYPE_CHECKING:
    from ckptctl.write.job import ExportJob

DEFAULT_TIMEOUT = 300.0
# What a collective or the store raises when a peer died, hung past the timeout or tore the group
# down (torch's DistError, DistStoreError and DistNetworkError are RuntimeErrors).
COLLECTIVE_ERRORS = (RuntimeError, ConnectionError, ValueError, TimeoutError)
_WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_NOTHING = "fix the failing rank's problem and run again; nothing was published"
LATE = ("every rank must make the same call (under torchrun: run the same command on every node); "
        "if ranks start late, raise the timeout (--timeout, or timeout= of the library call)")


class DistributedWriteError(OperationalError):
    """Raised on every rank when any rank failed a phase of a multi-rank write."""

    code = "distributed"

    def __init__(self, phase: str, failures: dict[int, str], *, hint: str = _NOTHING, lead: str = "") -> None:
        parts = "; ".join(f"rank {r}: {m}" if r >= 0 else m for r, m in sorted(failures.items()))
        super().__init__(f"{lead}multi-rank write failed in phase {phase}: {parts}", hint, phase=phase)
        self.failures = failures


class DistributedInterrupted(Interrupted):
    """This rank was interrupted (Ctrl-C, or SIGTERM/SIGHUP handled like it): exit 130 or 128 + the
    signal. The other ranks see it leave (their exchange fails, exit 3, naming it where the store
    outlives it) unless they were signalled too, as torchrun does."""

    def __init__(self, message: str, hint: str, *, phase: str, signum: int | None) -> None:
        super().__init__(message, hint, phase=phase)
        if signum is not None and signum != signal.SIGINT:
            self.exit_code = EXIT_SIGNAL_BASE + signum
        else:
            self.exit_code = EXIT_INTERRUPTED
        self.signum = signum

    def by_signal(self, signum: int, name: str) -> Interrupted:
        """The CLI names the signal it handled (exit 128 + it); this message may name it already."""
        self.exit_code = EXIT_SIGNAL_BASE + signum
        if name not in self.message:
            self.message = f"{name} received: {self.message}"
        return self


def cause_of(exc: BaseException) -> str:
    """torch's message, one line: without Gloo's source location and its advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text).split(". This is typically")[0]
    return text[:200]


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum is not None else "an interrupt"


class Signals:
    """For the length of one call, on the main thread: which of SIGINT/SIGTERM/SIGHUP arrived
    first. Only signals the program already handles in Python are watched (wrapped: the program's
    own handler still runs, e.g. the CLI's, which raises KeyboardInterrupt); a signal whose
    disposition is the default or ignore keeps it. Inside :meth:`shield` a signal is recorded and
    its handler runs when the shielded block ends (cleanup is never cut short)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Callable[..., Any]] = {}
        self._shielded = False
        self._deferred: int | None = None
        self.settled = False  # this rank is already leaving, interrupted: later signals are only recorded

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for s in _WATCHED:
                handler = signal.getsignal(s)
                if callable(handler):
                    self._previous[s] = handler
                    signal.signal(s, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self.settled:
            return
        if self._shielded:
            self._deferred = self._deferred or signum
            return
        self._previous[signum](signum, frame)

    @contextmanager
    def shield(self) -> Iterator[None]:
        if self._shielded:
            yield
            return
        self._shielded = True
        try:
            yield
        finally:
            self._shielded = False
            deferred, self._deferred = self._deferred, None
            if deferred is not None:
                self._previous[deferred](deferred, None)


def default_store() -> Any:
    """The default process group's store (None where torch does not expose it)."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def run_prefix(store: Any, rank: int) -> str:
    """Keys of this call in the store: the n-th multi-rank write of every rank shares them."""
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        n = store.add(f"ckptctl/{run}/calls/{rank}", 1)
    except COLLECTIVE_ERRORS as exc:
        raise _store_lost(exc) from None
    return f"ckptctl/{run}/{n}"


def _store_lost(exc: BaseException) -> DistributedWriteError:
    return DistributedWriteError("join", {-1: f"the rendezvous store stopped answering (its host left?): "
                                              f"{cause_of(exc)}"}, hint=LATE)


def _missing(store: Any, prefix: str, world: int) -> list[int] | None:
    """The ranks whose key ``prefix/<rank>`` is not in the store (None: the store cannot tell)."""
    try:
        return [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
    except COLLECTIVE_ERRORS:
        return None


def join(store: Any, prefix: str, rank: int, world: int, timeout: float) -> None:
    """Mark this rank's arrival and wait (in short sleeps) until every rank has arrived."""
    deadline = time.monotonic() + timeout
    keys = [f"{prefix}/{r}" for r in range(world)]
    pause = 0.001
    try:
        store.set(f"{prefix}/{rank}", b"1")
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = _missing(store, prefix, world) or []
                raise DistributedWriteError("join", {r: f"did not join within {timeout:g}s" for r in missing}
                                            or {-1: f"not every rank joined within {timeout:g}s"}, hint=LATE)
            time.sleep(pause)  # a signal's handler runs here
            pause = min(pause * 2, 0.05)
    except COLLECTIVE_ERRORS as exc:
        raise _store_lost(exc) from None


def init_from_env(timeout: float = DEFAULT_TIMEOUT) -> None:
    """``init_process_group("gloo")`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), bounded by ``timeout``: a rank that does not start, or a
    rendezvous host that does not answer, is a :class:`DistributedWriteError` naming it."""
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    try:
        store = dist.TCPStore(host, port, None, rank == 0 and not agent, timedelta(seconds=timeout),
                              wait_for_workers=False, multi_tenant=True)
    except COLLECTIVE_ERRORS as exc:
        if rank == 0 and not agent:
            raise DistributedWriteError("join", {0: f"cannot host the rendezvous at {host}:{port}: {cause_of(exc)}"},
                                        hint="check MASTER_ADDR and MASTER_PORT (the port may be in use)") from None
        host_rank = "torchrun's agent" if agent else "rank 0"
        raise DistributedWriteError("join", {0 if not agent else -1: (
            f"the rendezvous at {host}:{port} (hosted by {host_rank}) did not answer within {timeout:g}s: "
            f"{cause_of(exc)}")}, hint=LATE) from None
    join(store, run_prefix(store, rank) + "/init", rank, world, timeout)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    except COLLECTIVE_ERRORS as exc:  # a rank left between joining and the group's creation
        raise DistributedWriteError("join", {-1: f"the process group could not be formed: {cause_of(exc)}"},
                                    hint=LATE) from None


@dataclass
class Ctx:
    dist: Any
    group: Any
    rank: int
    world: int
    node: int
    node_ranks: list[int]  # global ranks of this rank's node (all ranks for shared storage)
    leader: int  # global rank that stages and publishes for this rank
    timeout: float = DEFAULT_TIMEOUT
    owns_group: bool = False  # we created the Gloo group: destroy it when done
    store: Any = None
    prefix: str = ""
    pending: bool = False  # an exchange this rank left unfinished (interrupted): never destroy the group

    def close(self) -> None:
        if self.owns_group and not self.pending:
            try:
                self.dist.destroy_process_group(self.group)
            except COLLECTIVE_ERRORS:
                pass  # a group broken by a dead peer cannot be torn down cleanly

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


class Exchange:
    """This rank's side of the protocol: run a phase's step, exchange every rank's outcome, agree;
    on any failure remove what the leader staged (never cut short by a signal)."""

    def __init__(self, ctx: Ctx, signals: Signals) -> None:
        self.ctx, self.signals = ctx, signals
        self.name = "join"  # the phase this rank is in
        self.seq = 0  # exchanges so far: the store key of each one's arrivals
        self.job: ExportJob | None = None
        self.removed: str | None = None  # the staging directory this rank removed
        self.left: str | None = None  # ... or could not remove

    # the exchange ---------------------------------------------------------------------------
    def gather(self, name: str, obj: Any) -> list[Any]:
        """``all_gather_object`` over the Gloo group, started asynchronously and waited for in
        short sleeps (a signal is handled at once). Marks this rank's arrival in the store first."""
        import torch

        ctx = self.ctx
        self.seq += 1
        if ctx.store is not None:
            try:
                ctx.store.set(f"{ctx.prefix}/{self.seq}/{ctx.rank}", b"1")
            except COLLECTIVE_ERRORS:
                pass  # the store's host is gone: the exchange below fails and says so
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world)]
        self._wait(ctx.dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=ctx.group,
                                       async_op=True))
        n = max(int(s) for s in sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(ctx.world)]
        self._wait(ctx.dist.all_gather(bufs, mine, group=ctx.group, async_op=True))
        return [pickle.loads(b[:int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def _wait(self, work: Any) -> None:
        """Until ``work`` completes (the group's timeout fails it; ours is a backstop)."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.timeout + 2.0
        pause = 0.0005
        ctx.pending = True
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {ctx.timeout:g}s")
            time.sleep(pause)  # a signal's handler runs here
            pause = min(pause * 2, 0.02)
        ctx.pending = False
        work.wait()  # raises what failed it

    # a phase --------------------------------------------------------------------------------
    def phase(self, name: str, fn: Callable[[], Any]) -> list[Any]:
        """Run ``fn`` on this rank; gather every rank's outcome; raise the same error everywhere.
        An interruption (KeyboardInterrupt) leaves at once: the caller turns it into
        :class:`DistributedInterrupted`."""
        self.name = name
        error: str | None = None
        value: Any = None
        try:
            _faults.point(f"dist-{name}")
            value = fn()
        except CkptctlError as exc:
            error = str(exc.message)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
            error = f"{type(exc).__name__}: {exc}"
        published = self.published()
        try:
            outcomes = self.gather(name, (error, value, published))
        except COLLECTIVE_ERRORS as exc:
            raise self._broken(name, error, exc, published) from None
        failed = {r: o[0] for r, o in enumerate(outcomes) if o[0] is not None}
        if failed:
            self.abort()
            by = [r for r, o in enumerate(outcomes) if o[2]]
            if by:
                raise DistributedWriteError(name, failed, hint=self._after_publish_hint(),
                                            lead=f"{self.dest} holds the new version (published by rank "
                                                 f"{', '.join(map(str, by))}), but the ")
            raise DistributedWriteError(name, failed)
        return [o[1] for o in outcomes]

    def _broken(self, name: str, error: str | None, exc: BaseException, published: bool) -> DistributedWriteError:
        """The exchange itself failed: a rank died, hung past the timeout or left."""
        self.abort()
        ctx = self.ctx
        cause = cause_of(exc)
        failures = {ctx.rank: error} if error else {}
        for r, name_ in self._left().items():
            failures.setdefault(r, f"interrupted by {name_}: it left the multi-rank write")
        missing = _missing(ctx.store, f"{ctx.prefix}/{self.seq}", ctx.world) if ctx.store is not None else None
        for r in missing or []:
            failures.setdefault(r, f"collective failed: it did not finish phase {name} within {ctx.timeout:g}s "
                                   f"(it died, hangs or left): {cause}")
        if not missing:
            failures.setdefault(-1, f"collective failed (a rank died or timed out): {cause}")
        if published:
            return DistributedWriteError(name, failures, hint=self._after_publish_hint(),
                                         lead=f"{self.dest} holds the new version (published by rank {ctx.rank}), "
                                              "but the ")
        if name == "publish" and not ctx.is_leader:
            return DistributedWriteError(name, failures, hint=f"check {self.dest} (`ckptctl verify {self.dest}`): "
                                         f"rank {ctx.leader} may have published it before the exchange failed",
                                         lead=f"whether {self.dest} holds the new version is unknown, and the ")
        return DistributedWriteError(name, failures)

    def _left(self) -> dict[int, str]:
        """The ranks that said in the store that they left, interrupted (rank -> signal name)."""
        ctx, left = self.ctx, {}
        if ctx.store is None:
            return left
        try:
            for r in range(ctx.world):
                if r != ctx.rank and ctx.store.check([f"{ctx.prefix}/left/{r}"]):
                    left[r] = ctx.store.get(f"{ctx.prefix}/left/{r}").decode()
        except COLLECTIVE_ERRORS:
            pass  # the store's host left too
        return left

    def _after_publish_hint(self) -> str:
        return (f"nothing to redo for the data: fix what failed after the publish; `ckptctl gc-tmp "
                f"{Path(self.dest).parent}` removes anything left behind")

    # cleanup ----------------------------------------------------------------------------------
    @property
    def dest(self) -> str:
        return str(self.job.dest) if self.job is not None else "the destination"

    def published(self) -> bool:
        stage = self.job.stage_ if self.job is not None else None
        return stage is not None and stage.published

    def abort(self) -> str | None:
        """Remove what this rank staged (the leader's staging directory), shielded from signals.
        Returns the staging directory when it is still there afterwards."""
        stage = self.job.stage_ if self.job is not None else None
        where = stage.dir if stage is not None else None
        try:
            with self.signals.shield():
                if self.job is not None:
                    self.job.abort()
        finally:  # (a signal deferred by the shield is raised at its end)
            if where is not None and os.path.lexists(where):
                self.left = str(where)
            elif where is not None:
                self.removed, self.left = str(where), None
        return self.left

    def interrupted(self) -> DistributedInterrupted:
        """After a KeyboardInterrupt on this rank: clean up, then the error to raise."""
        self.signals.settled = True
        left = self.abort()
        ctx, signum = self.ctx, self.signals.signum
        if ctx.store is not None:
            try:  # the others' exchange fails when this rank leaves: they name it
                ctx.store.set(f"{ctx.prefix}/left/{ctx.rank}", signal_name(signum).encode())
            except COLLECTIVE_ERRORS:
                pass
        what = f"multi-rank write interrupted by {signal_name(signum)} on rank {ctx.rank}"
        if self.published():
            return DistributedInterrupted(f"{what} after publishing: {self.dest} holds the new version",
                                          "nothing to redo; `ckptctl gc-tmp` removes anything left behind",
                                          phase=self.name, signum=signum)
        if self.name == "publish" and not ctx.is_leader:
            return DistributedInterrupted(
                f"{what} in phase publish; whether rank {ctx.leader} published {self.dest} is unknown",
                f"check it (`ckptctl verify {self.dest}`); run the command again if it holds the previous version",
                phase=self.name, signum=signum)
        if left:  # its lock is released: gc-tmp (or the next run) proves it dead
            gc = f"`ckptctl gc-tmp {Path(left).parent} --min-age 0`"
            if self.name == "publish":  # a publish half done and kept for recovery
                return DistributedInterrupted(f"{what} while publishing; the staging directory {left} is kept",
                                              f"run {gc} (or the command again): it completes or undoes the "
                                              "publish", phase=self.name, signum=signum)
            done = f"the staging directory {left} could not be removed ({gc} removes it)"
        elif self.removed:
            done = f"the staging directory {Path(self.removed).name} was removed"
        else:
            done = "this rank staged nothing"
        return DistributedInterrupted(f"{what} in phase {self.name}; {done}; nothing was published",
                                      "run the command again to start over", phase=self.name, signum=signum)
