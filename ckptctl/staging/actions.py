"""What is done to a staging directory once :func:`~ckptctl.staging.state.inspect` has judged it:
roll a half-done publish forward or back, remove the directory, and both for a destination."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ckptctl.errors import LockHeldError, OperationalError
from ckptctl.staging.fs import fsync_path, remove_at, rename
from ckptctl.staging.liveness import on_this_host
from ckptctl.staging.lock import LOCK, StagingLock, acquire
from ckptctl.staging.record import DATA, OLD, OWNER, siblings
from ckptctl.staging.state import State, StagingState, inspect, phase


def roll(staging_dir: Path, dest: Path, *, forward: bool, fsync: bool = True) -> str:
    """Finish a half-done exchange-less publish: ``data/`` onto ``dest`` (forward) or ``old/`` back
    onto it (back). Returns 'rolled-forward' or 'rolled-back'. A rename whose reply was lost but
    that was done counts as done (``fs.rename``)."""
    rename(staging_dir / (DATA if forward else OLD), dest)
    if fsync:
        fsync_path(dest.parent, directory=True)
    return "rolled-forward" if forward else "rolled-back"


def recover(st: StagingState) -> str | None:
    """Act on a dead writer's half-done publish as its state says. Returns what was done
    ('rolled-forward', 'rolled-back') or None when nothing was pending. The caller holds the lock."""
    if not st.state.half_published:
        return None
    assert st.dest is not None
    return roll(st.path, st.dest, forward=st.state is State.HALF_PUBLISHED_FORWARD)


def remove_staging_at(parent_fd: int, name: str, *, where: Path, lock: StagingLock | None = None) -> int:
    """Remove the staging directory ``name`` under ``parent_fd`` (``where`` is its path); bytes freed.

    Everything else first, then the owner record, the lock last: an interrupted removal stays
    recognisable, and a racing gc run finds no owner and backs off. ``lock`` (the
    caller's hold on this directory's lock) is closed just before the lock file is unlinked: a file
    unlinked while open is silly-renamed on NFS (hidden by libfuse) and would keep the directory
    from going. Refused (EEXIST) while ``old/`` or ``data/`` may hold the only copy of a version
    (half-published, or in conflict)."""
    try:
        state = phase(where)
    except FileNotFoundError:
        return 0  # gone already (another gc run)
    if state.protected:
        raise OSError(errno.EEXIST, "old/ holds the only copy of a checkpoint version; not removing", str(where))
    return remove_at(parent_fd, name, where=str(where), keep_last=(OWNER, LOCK),
                     before_last=lock.release if lock is not None else None)


def remove_staging(d: Path, *, lock: StagingLock | None = None) -> int:
    """:func:`remove_staging_at` by path."""
    pfd = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return remove_staging_at(pfd, d.name, where=d, lock=lock)
    finally:
        os.close(pfd)


def competitor_error(dest: Path, st: StagingState) -> LockHeldError:
    """The refusal of a second writer for ``dest`` while ``st`` (a live writer's) exists."""
    owner = st.owner or {}
    return LockHeldError(
        f"another writer is already writing {dest} (pid {owner.get('pid', '?')} on {owner.get('host', '?')}, "
        f"staging {st.path.name}" + (f"; {st.live.reason})" if st.live.error else ")"),
        "wait for it to finish; if it is dead, `ckptctl gc-tmp` will clean it up", phase="stage")


def conflict_message(dest: Path, staging_dir: Path) -> tuple[str, str]:
    """Message and hint for a staging directory in CONFLICT: what is where, and what to do."""
    return (f"a half-done publish of {dest} collided with a directory that is not ours: the previous version is "
            f"in {staging_dir / OLD}, the new one (if complete) in {staging_dir / DATA}; nothing was deleted",
            f"look at what is at {dest}; move it aside, then run `ckptctl gc-tmp {dest.parent} --min-age 0` to "
            f"finish the publish (or move {staging_dir / OLD} back yourself and remove {staging_dir})")


def recover_destination(dest: Path) -> list[str]:
    """Before writing ``dest``: finish any half-done publish a dead writer left for it, and remove
    the dead writer's staging directory when it ran on this host (others are gc-tmp's, by age).
    The staging lock is taken first, so a concurrent gc-tmp run and this never work on one
    directory at once. Each directory is judged on its own facts (``state.phase``), never by the
    order of the listing. Returns what was done, one line per directory rolled.

    Raises :class:`LockHeldError` when a live writer is between the two renames of its publish
    (the destination is missing only for that instant: this command is a second writer), and
    :class:`OperationalError` when a dead writer's publish is in CONFLICT (a human must decide)."""
    done = []
    for d in sorted(siblings(dest.parent, dest.name)):
        try:
            seen = inspect(d)
            if seen.live.alive:
                if seen.owner is not None and phase(d).half_published:
                    raise competitor_error(dest, seen)
                continue
            if seen.owner is None:
                continue
            lock = acquire(d)
        except OSError:
            continue
        if lock is None:
            continue  # someone (gc-tmp, a writer) holds it
        with lock:
            try:
                st = inspect(d, locked=True)
                if st.owner != seen.owner or st.live.alive:
                    continue
                if st.state is State.CONFLICT:
                    raise OperationalError(*conflict_message(dest, d), phase="plan")
                what = recover(st)
                if what:
                    done.append(f"{d.name}: {what}")
                if on_this_host(st.owner):
                    remove_staging(d, lock=lock)
            except OSError:
                continue
    return done
