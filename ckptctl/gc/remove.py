"""gc-tmp's removal: re-check each would-remove candidate right before, then remove it on directory
file descriptors reached from the root with O_NOFOLLOW (a staging directory under its own lock,
after its half-done publish, if any, was rolled forward or back), never across a mount point
(``staging.MountInside``: reported with a hint, the mounted filesystem untouched)."""

from __future__ import annotations

import os

from ckptctl import staging
from ckptctl.gc.judge import alive_reason, live_inside
from ckptctl.gc.model import Candidate, Decision, GcProblem, GcResult, Kind, Progress
from ckptctl.gc.scan import measure
from ckptctl.staging import State


def _remove_staging(c: Candidate, parent_fd: int) -> None:
    if c.owner is not None:
        # 1. fresh verdict (a gc run may have overlapped, time has passed since the scan)
        fresh = staging.inspect(c.path)
        if fresh.owner is None:
            return c.decide(Decision.VANISHED, "owner record gone (removed by another gc run?)")
        if fresh.owner != c.owner:
            return c.decide(Decision.KEPT, "owner record changed since the scan")
        if fresh.live.alive:
            return c.decide(Decision.KEPT, alive_reason(fresh.live))
        held = "another gc run, or a writer"
    else:
        held = "a writer starting, or another gc run"
    # 2. take the staging lock ourselves: a second gc run (or anyone) now backs off. A stub's lock
    #    is never created: one made here and unlinked while held would be silly-renamed on NFS
    #    (hidden by libfuse) and keep the stub forever; a stub without a lock is removed as it is.
    try:
        lock = staging.acquire(c.path, parent_fd=parent_fd, create=c.owner is not None)
    except FileNotFoundError:
        if c.owner is not None or not _present(parent_fd, c.path.name):
            return c.decide(Decision.VANISHED, "removed meanwhile (another gc run?)")
        if staging.inspect(c.path).state is not State.STUB:
            return c.decide(Decision.KEPT, "no longer an empty stub (a writer is using it)")
        c.freed = staging.remove_staging_at(parent_fd, c.path.name, where=c.path)
        c.decision = Decision.REMOVED
        return None
    if lock is None:
        return c.decide(Decision.KEPT, f"its lock is held now ({held})")
    with lock:
        st = staging.inspect(c.path, locked=True)
        if c.owner is None and st.state is not State.STUB:
            return c.decide(Decision.KEPT, "no longer an empty stub (a writer is using it)")
        if c.owner is not None and st.owner != c.owner:
            return c.decide(Decision.VANISHED, "owner record gone (removed by another gc run?)")
        # 3. a half-done exchange-less publish: restore the checkpoint first
        c.recovery = staging.recover(st)
        # 4. remove: data first, the journal, the owner record and the lock last (closed before it is
        #    unlinked); refused while old/ may hold the only copy of a version
        c.freed = staging.remove_staging_at(parent_fd, c.path.name, where=c.path, lock=lock)
        c.decision = Decision.REMOVED


def _present(parent_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _remove_foreign(c: Candidate, parent_fd: int) -> None:
    name = c.path.name
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return c.decide(Decision.VANISHED, "removed meanwhile")
    if (st.st_dev, st.st_ino) != c.ino or st.st_mtime > c.mtime:
        return c.decide(Decision.KEPT, "changed since the scan")
    why = live_inside(c, measure(c.path).nested_staging if c.is_dir else [])
    if why:
        return c.decide(Decision.KEPT, why)
    c.freed = staging.remove_at(parent_fd, name, where=str(c.path))
    c.decision = Decision.REMOVED


def remove(res: GcResult, progress: Progress | None = None) -> GcResult:
    """Remove every would-remove candidate (re-checking each right before); errors are recorded."""
    for c in res.candidates:
        if c.decision != Decision.WOULD_REMOVE:
            continue
        try:
            parent_fd = staging.open_beneath(c.root, c.path.relative_to(c.root).parts[:-1])
        except FileNotFoundError:
            c.decide(Decision.VANISHED, "removed meanwhile")
            continue
        except OSError as exc:
            _fail(res, c, f"cannot open its parent without following links: {exc.strerror}")
            continue
        try:
            if c.kind == Kind.OURS:
                _remove_staging(c, parent_fd)
            else:
                _remove_foreign(c, parent_fd)
        except staging.Deferred as exc:
            c.decide(Decision.DEFERRED, exc.strerror or str(exc))
        except staging.NotALock as exc:
            _fail(res, c, exc.strerror or str(exc), hint=NOT_A_LOCK_HINT)
        except staging.MountInside as exc:  # never removed across: the mounted filesystem is left whole
            _fail(res, c, f"cannot remove {exc.filename}: {exc.strerror}", hint=MOUNT_HINT.format(exc.filename))
        except FileNotFoundError as exc:
            # an overlapping gc run removed it while we looked (its re-check lists the directory
            # before any lock is taken): vanished, not a failure; anything else missing is one
            if _present(parent_fd, c.path.name):
                _fail(res, c, f"{exc.strerror or exc}: {exc.filename}")
            else:
                c.decide(Decision.VANISHED, "removed meanwhile (another gc run?)")
        except OSError as exc:
            what = exc.filename if exc.filename and str(exc.filename) != str(c.path) else None
            _fail(res, c, f"cannot remove {what}: {exc.strerror or exc}" if what else f"{exc.strerror or exc}")
        finally:
            os.close(parent_fd)
        if progress and c.decision in (Decision.REMOVED, Decision.DEFERRED, Decision.FAILED):
            progress(f"{c.decision} {c.path}" + (f" ({c.recovery})" if c.recovery else ""))
    return res


NOT_A_LOCK_HINT = ("its lock was replaced by a symbolic link or a non-file, so no writer can hold it and gc-tmp "
                   "will not remove it: look at the directory and remove it by hand")


MOUNT_HINT = ("unmount {} (it is another filesystem, or a bind mount, inside the directory), then run gc-tmp again; "
              "nothing on it was removed")


def _fail(res: GcResult, c: Candidate, message: str, hint: str | None = None) -> None:
    c.decision, c.error = Decision.FAILED, message
    c.reason = f"{c.reason}; removal failed: {message}" if c.reason else message
    res.problems.append(GcProblem(str(c.path), message, hint))
