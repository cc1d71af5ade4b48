"""What is done to a staging directory once :func:`~ckptctl.staging.state.inspect` has judged it:
roll a half-done publish forward or back, remove the directory, and both for a destination."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ckptctl.staging.fs import fsync_path, remove_at
from ckptctl.staging.liveness import on_this_host
from ckptctl.staging.lock import LOCK, acquire
from ckptctl.staging.record import DATA, OLD, OWNER, siblings
from ckptctl.staging.state import State, StagingState, inspect, phase


def roll(staging_dir: Path, dest: Path, *, forward: bool, fsync: bool = True) -> str:
    """Finish a half-done exchange-less publish: ``data/`` onto ``dest`` (forward) or ``old/`` back
    onto it (back). Returns 'rolled-forward' or 'rolled-back'."""
    os.rename(staging_dir / (DATA if forward else OLD), dest)
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


def remove_staging_at(parent_fd: int, name: str, *, where: Path) -> int:
    """Remove the staging directory ``name`` under ``parent_fd`` (``where`` is its path); bytes freed.

    Everything else first, then the owner record, the lock last: an interrupted removal stays
    recognisable, and a racing gc run finds no owner and backs off. Refused (EEXIST) while a
    half-done publish leaves ``old/`` as the only copy of the destination."""
    if phase(where).half_published:
        raise OSError(errno.EEXIST, "old/ holds the only copy of the checkpoint; not removing", str(where))
    return remove_at(parent_fd, name, where=str(where), keep_last=(OWNER, LOCK))


def remove_staging(d: Path) -> int:
    """:func:`remove_staging_at` by path."""
    pfd = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return remove_staging_at(pfd, d.name, where=d)
    finally:
        os.close(pfd)


def recover_destination(dest: Path) -> list[str]:
    """Before writing ``dest``: finish any half-done publish a dead writer left for it, and remove
    the dead writer's staging directory when it ran on this host (others are gc-tmp's, by age).
    The staging lock is taken first, so a concurrent gc-tmp run and this never work on one
    directory at once. Returns what was done, one line per directory rolled."""
    done = []
    for d in siblings(dest.parent, dest.name):
        try:
            seen = inspect(d)
            if seen.owner is None or seen.live.alive:
                continue
            lock = acquire(d)
        except OSError:
            continue
        if lock is None:
            continue  # someone (gc-tmp, a writer) holds it
        try:
            with lock:
                st = inspect(d, locked=True)
                if st.owner != seen.owner or st.live.alive:
                    continue
                what = recover(st)
                if what:
                    done.append(f"{d.name}: {what}")
                if on_this_host(st.owner):
                    remove_staging(d)
        except OSError:
            continue
    return done
