"""Staging, fsync and the atomic publish of a checkpoint directory (DESIGN.md section 2).

``Stage`` creates ``<parent>/_tmp_<name>.<stamp>-<rand>/`` with its owner record under an
``flock``, gives the writer ``data/`` to fill, and publishes ``data/`` onto the destination:

- destination absent when the job was planned: ``renameat2(RENAME_NOREPLACE)`` (check + plain
  ``rename`` where unsupported), so a directory that appeared meanwhile is never replaced;
- destination present (and ``--overwrite``): ``renameat2(RENAME_EXCHANGE)``, after which
  ``data/`` holds the old version and is removed with the staging directory;
- exchange unsupported (EINVAL/ENOSYS, e.g. NFS): a journaled two-rename. ``ready`` is written
  and fsynced first, with the staging directory; it holds the journal (the identity of the
  destination's directory and of ``data/``). Then ``dest -> <staging>/old``, then
  ``<staging>/data -> dest``. A crash in between leaves a staging directory whose state
  (:func:`ckptctl.staging.inspect`) is half-published: :func:`ckptctl.staging.recover` rolls it
  forward (``ready`` present and ``data/`` complete) or back (``old/`` renamed onto the
  destination), so the destination is never lost. The next run on the same destination
  (``recover_destination``) and ``gc-tmp`` call it; the writer's own cleanup never removes such a
  directory, nor one in CONFLICT, and never ``old/``.

A rename that fails is checked against the directories themselves before anything else is
decided (``staging.rename``): on NFS a rename can be done although its reply was lost (EIO), and
the kernel's name cache still shows the old names. Such a rename counts as done.

Filesystems whose directory rename is a copy and a delete (object-store FUSE mounts: gcsfuse,
s3fs, ...) cannot replace a destination atomically: ``--overwrite`` is refused there
(:func:`check_destination`).

A directory rename carries the mounts below it: a destination with a filesystem mounted inside
it is refused before any work, and again just before the publish (:func:`refuse_mounts_below`);
the removal of the old version never crosses a mount point (``staging.MountInside``).

Every file, the staging directory and the parent are fsynced (unless ``fsync=False``); an fsync
error aborts the publish and is never retried (fsyncgate).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ckptctl import _faults, _libc, staging
from ckptctl.errors import CkptctlError, LockHeldError, OperationalError, UsageError, from_oserror
from ckptctl.format.names import destination_problem, parse_staging_name, staging_name, visible_staging_name
from ckptctl.staging import fsync_path
from ckptctl.staging.keep import carry_late, entries, keep_permissions

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def _renameat2(src: Path, dst: Path, flags: int) -> None:
    """renameat2(2); raises OSError naming both paths (ENOSYS where libc lacks it)."""
    try:
        _libc.renameat2(os.fsencode(src), os.fsencode(dst), flags)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(src), None, str(dst)) from None


class Stage:
    """One writer's staging directory for one destination."""

    def __init__(self, dest: Path, *, fsync: bool = True, command: str | None = None,
                 known: dict[str, int] | None = None) -> None:
        self.dest = Path(os.path.abspath(dest))
        self.parent = self.dest.parent
        self.fsync = fsync
        self.command = command
        self.dir: Path | None = None
        self.lock: staging.StagingLock | None = None
        self.published = False
        self.kept = False  # a failed publish left the staging directory for recovery (said so)
        # The destination's entries at every depth (relative path -> inode) when the plan listed it
        # (``known``), else when staging began: what appears after that is carried by the publish.
        self.known: dict[str, int] = known or {}
        self._known_given = known is not None
        self.late: list[str] = []  # entries that appeared in the destination while we wrote: carried
        self.kept_aside: list[str] = []  # ... under another name, where the new version has that name

    @property
    def data(self) -> Path:
        assert self.dir is not None
        return self.dir / staging.DATA

    # ------------------------------------------------------------------------------------
    def create(self) -> Path:
        """Make the staging directory fully formed under its hidden name (lock held, owner record,
        data/), then rename it to its visible name: gc-tmp never sees a staging directory whose
        writer has not taken its lock yet, whatever ``--min-age`` it is given."""
        _faults.point("stage-create")
        if not self._known_given:
            self.known = entries(self.dest)
        hidden = self.parent / staging_name(self.dest.name, hidden=True)
        try:
            os.mkdir(hidden, 0o755)
        except OSError as exc:
            raise from_oserror(exc, "cannot create the staging directory", phase="stage") from None
        self.dir = hidden
        try:
            self.lock = staging.acquire(hidden, patience=1.0)  # our own new lock: only a probe can hold it
            if self.lock is None:
                raise BlockingIOError(errno.EWOULDBLOCK, "its lock is held by another process",
                                      str(hidden / staging.LOCK))
            record = json.dumps(staging.owner_record(self.dest, self.command), indent=2).encode()
            self._write_small(hidden / staging.OWNER, record)
            os.mkdir(hidden / staging.DATA, 0o755)
            _faults.point("stage-visible")
            visible = self.parent / visible_staging_name(hidden.name)
            staging.rename(hidden, visible)
            self.dir = visible
        except OSError as exc:
            self.abort()
            raise from_oserror(exc, "cannot prepare the staging directory", phase="stage") from None
        _faults.point("stage-created")
        return self.data

    def _write_small(self, path: Path, data: bytes) -> None:
        staging.write_small(path, data, fsync=self.fsync)

    def write_file(self, name: str, data: bytes) -> None:
        """Write a small file into data/ (index, manifest, config)."""
        self._write_small(self.data / name, data)

    def check_competitors(self) -> None:
        """Refuse when another live writer for the same destination started before us."""
        assert self.dir is not None
        mine = parse_staging_name(self.dir.name)
        assert mine is not None
        for other in staging.siblings(self.parent, self.dest.name):
            parsed = parse_staging_name(other.name)
            if other == self.dir or parsed is None or parsed[1] > mine[1]:
                continue
            try:
                st = staging.inspect(other)
            except OSError:
                continue  # only a dead writer's entries are examined (and can fail)
            if st.live.alive:
                raise staging.competitor_error(self.dest, st)

    # ------------------------------------------------------------------------------------
    def seal(self) -> None:
        """fsync data/ (and its subdirectories) and mark the staging directory ready: ``ready``
        holds the publish journal (what the destination and ``data/`` are now)."""
        assert self.dir is not None
        try:
            keep_permissions(self.dest, self.data)
            if self.fsync:
                for root, dirs, _files in os.walk(self.data):
                    for d in dirs:
                        fsync_path(Path(root) / d, directory=True)
                _faults.point("fsync-dir")
                fsync_path(self.data, directory=True)
            record = staging.journal_record(self.dest, self.data)
            self._write_small(self.dir / staging.READY, json.dumps(record, indent=2).encode() + b"\n")
            if self.fsync:
                fsync_path(self.dir, directory=True)
        except OSError as exc:
            raise from_oserror(exc, "cannot make the staged checkpoint durable", phase="seal") from None
        _faults.point("sealed")

    def publish(self, *, replace: bool) -> str:
        """Make data/ the destination. Returns how: 'rename', 'exchange' or 'two-rename'.

        ``replace`` is whether the destination existed when the job was planned (and may be
        replaced). When it did not, the rename never replaces anything: a directory that appeared
        meanwhile makes the publish fail instead of being swapped out and deleted."""
        assert self.dir is not None
        dest, data = self.dest, self.data
        exists = replace and os.path.lexists(dest)
        _faults.point("publish")
        if exists:
            refuse_mounts_below(dest, after_plan=True)  # one mounted while we wrote: never moved, never emptied
        try:
            if not exists:
                how = "rename"
                rename_into_place(data, dest)
            else:
                how = "exchange"
                try:
                    _faults.point("exchange")
                    _renameat2(data, dest, RENAME_EXCHANGE)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                        raise
                    how = "two-rename"
                    self._two_rename()
            self.published = True
        except CkptctlError:
            raise
        except OSError as exc:
            self._undo_half_publish()
            raise from_oserror(exc, "cannot publish the checkpoint", phase="publish") from None
        if how != "rename":
            self._carry_late(data if how == "exchange" else self.dir / staging.OLD)
        try:
            _faults.point("published")
            if self.fsync:
                fsync_path(self.parent, directory=True)
                fsync_path(self.dir, directory=True)
        except OSError as exc:
            cause = from_oserror(exc, "fsync after the rename")
            raise OperationalError(
                f"the new version of {dest} is in place, but making it durable failed: {cause.message}",
                "the storage reported an error: check the device; after a power cut the destination may hold "
                "the previous version", phase="publish") from None
        return how

    def _carry_late(self, old: Path) -> None:
        """Move into the published version what appeared in the old one while we wrote
        (:func:`ckptctl.staging.keep.carry_late`); when that fails, keep the staging directory
        (the old version with those files) and say where."""
        try:
            self.late, self.kept_aside = carry_late(old, self.dest, self.known)
        except OSError as exc:
            raise self._late_failed(exc, Path(exc.filename) if exc.filename else old) from None

    def _late_failed(self, exc: OSError, where: Path) -> OperationalError:
        """The new version is published but something added meanwhile could not be moved over:
        keep the staging directory (and so the old version with it) and say where."""
        self.kept = True
        assert self.dir is not None
        cause = exc.strerror or str(exc)
        return OperationalError(
            f"{self.dest} holds the new version, but what was added to it while we wrote could not be carried "
            f"over ({cause}: {where}); the previous version, with those files, is kept in {self.dir}",
            f"move what you need from {self.dir} into {self.dest}, then remove it "
            f"(`ckptctl gc-tmp {self.parent}` does once it is yours to drop)", phase="publish")

    def _two_rename(self) -> None:
        """The exchange-less publish (journaled in ``ready`` by :meth:`seal`): ``dest -> old/``,
        ``data/ -> dest``. Each rename that reports an error but was done (a lost reply) counts
        as done."""
        assert self.dir is not None
        staging.rename(self.dest, self.dir / staging.OLD)
        _faults.point("two-rename-between")
        staging.rename(self.data, self.dest)

    def _undo_half_publish(self) -> None:
        """:func:`undo_half_publish` of this staging directory; when that cannot be done the
        staging directory stays for the next run or gc-tmp, and :meth:`abort` does not try again."""
        assert self.dir is not None
        try:
            undo_half_publish(self.dir, self.dest, fsync=self.fsync)
        except OperationalError:
            self.kept = True
            raise

    def finish(self) -> None:
        """Remove the staging directory (with the old version) and drop the lock (closed before
        the lock file is unlinked). A half-done publish that could not be undone, or one in
        conflict, stays for the next run (or gc-tmp, or a human)."""
        if self.dir is None:
            return
        mounted: staging.MountInside | None = None
        try:
            if not self.kept:
                staging.remove_staging(self.dir, lock=self.lock)
        except staging.MountInside as exc:
            mounted = exc  # the removal stopped at a mount point: nothing of it was touched
        except OSError:
            pass  # leftovers are the next run's or gc-tmp's job
        finally:
            if self.lock:
                self.lock.release()
            where, self.dir = self.dir, None
        if mounted is not None and self.published:
            self.kept = True
            raise _mounted_in_old(self.dest, where, mounted)

    def abort(self) -> None:
        """Before publish: remove everything we staged. Never touches the destination, never
        removes ``old/``."""
        if self.dir is None:
            return
        if not self.published and not self.kept:
            try:
                self._undo_half_publish()
            except CkptctlError:
                pass  # the staging directory stays (its removal is refused): recovery's job
        self.finish()


def _mounted_in_old(dest: Path, where: Path, exc: OSError) -> OperationalError:
    return OperationalError(f"{dest} holds the new version, but a filesystem is mounted inside the previous one "
                            f"({exc.filename}): {where} was kept, nothing on that filesystem was removed",
                            f"unmount {exc.filename} (or `mount --move` it where it belongs), then run "
                            f"`ckptctl gc-tmp {dest.parent}`", phase="cleanup")


def _appeared(dest: Path) -> LockHeldError:
    return LockHeldError(f"{dest} appeared while we were writing it; it was left as it is",
                         "another process created it: check it, then run again (with --overwrite to replace it)",
                         phase="publish")


# Filesystem types (``/proc/self/mountinfo``) whose directory rename copies every object and then
# deletes the originals: a reader or a crash sees a mix. Object-store FUSE mounts.
NON_ATOMIC_RENAME = frozenset({
    "fuse.gcsfuse", "fuse.s3fs", "fuse.goofys", "fuse.geesefs", "fuse.rclone", "fuse.mountpoint-s3",
    "fuse.blobfuse", "fuse.blobfuse2", "fuse.ossfs", "fuse.cosfs", "fuse.obsfs",
})


def filesystem_type(path: Path) -> str | None:
    """The type ``/proc/self/mountinfo`` gives the filesystem holding ``path`` (matched by device
    number), or None when it cannot be told."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) > 2 and fields[2] == want and right.split():
            return right.split()[0]
    return None


def check_destination(dest: Path, *, overwrite: bool) -> bool:
    """Validate the destination before any work. Returns whether it exists."""
    try:
        name_max = os.pathconf(dest.parent, "PC_NAME_MAX")
    except OSError:
        name_max = 255
    problem = destination_problem(dest.name, name_max)
    if problem:
        raise UsageError(problem, "choose a destination name without control characters, short enough for the "
                                  "staging directory beside it")
    if os.path.lexists(dest):
        if not overwrite:
            raise UsageError(f"destination {dest} already exists",
                             "pass --overwrite to replace it atomically (the old version stays intact until "
                             "the new one is complete)")
        if not os.path.isdir(dest):
            raise UsageError(f"destination {dest} exists and is not a directory",
                             "remove it or choose another destination")
        try:
            mount_point = os.stat(dest).st_dev != os.stat(dest.parent).st_dev or staging.is_mount_point(dest)
            if mount_point and not os.path.islink(dest):
                raise OperationalError(f"destination {dest} is a mount point; it cannot be replaced atomically",
                                       "write to a directory inside it instead", phase="plan")
        except OSError as exc:
            raise from_oserror(exc, "cannot examine the destination", phase="plan") from None
        refuse_mounts_below(dest, after_plan=False)
        fstype = filesystem_type(dest.parent)
        if fstype in NON_ATOMIC_RENAME:
            raise OperationalError(
                f"{dest.parent} is on {fstype}, an object-store mount whose directory rename copies and deletes "
                f"every file: replacing {dest} cannot be atomic (a reader or a crash would see a mix)",
                "write the new version to a new directory (without --overwrite) and point readers at it, or write "
                "it on a POSIX filesystem and upload it (see docs/RELIABILITY.md)", phase="plan")
        return True
    return False


def refuse_mounts_below(dest: Path, *, after_plan: bool) -> None:
    """Refuse to replace ``dest`` while a filesystem is mounted below it (a volume, a tmpfs, a bind
    mount, a file bind-mounted over a file): a directory rename carries its mounts, so the publish
    would move the mount into the staging directory (to be removed) and the new version would
    hold a copy of its files. Before any work (``after_plan`` False): a usage error, exit 2; just
    before the publish (a mount made while we wrote): exit 3, nothing replaced."""
    below = staging.mounts_below(dest)
    if not below:
        return
    where = ", ".join(str(p) for p in below)
    if not after_plan:
        raise UsageError(f"{dest} has a filesystem mounted inside it ({where}); replacing {dest} would move the "
                         "mount out of it and copy its files into the new version",
                         "unmount it (or mount it beside the checkpoint, not inside), or write the new version to "
                         "another directory; nothing was written", phase="plan")
    raise OperationalError(f"a filesystem was mounted inside {dest} while the new version was written ({where}); "
                           f"{dest} was not replaced", "unmount it (or mount it beside the checkpoint, not inside), "
                           "then run the command again", phase="publish")


def check_writable(parent: Path) -> None:
    """Refuse a read-only filesystem before any work (the staging directory lives in ``parent``)."""
    try:
        st = os.statvfs(parent)
    except OSError as exc:
        raise from_oserror(exc, "cannot examine the destination's filesystem", phase="plan") from None
    if st.f_flag & os.ST_RDONLY:
        raise OperationalError(f"{parent} is on a read-only filesystem",
                               "write to a writable location or remount the filesystem read-write", phase="plan")
    if st.f_blocks == 0:  # /proc, /sys: a kernel's view, no storage (statvfs says 0 blocks, not 0 free)
        raise OperationalError(f"{parent} is not a real filesystem (no storage: /proc, /sys and the like)",
                               "write to a directory on a disk; nothing was written", phase="plan")


def free_space(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def rename_into_place(data: Path, dest: Path) -> None:
    """Rename the staged ``data`` to ``dest``, which must not exist: never replacing anything (a
    directory that appeared meanwhile is :func:`_appeared`). Where the filesystem has no
    ``RENAME_NOREPLACE``, a check then a rename (a small race); a rename done whose reply was lost
    counts as done."""
    try:
        _faults.point("rename-noreplace")
        _renameat2(data, dest, RENAME_NOREPLACE)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise _appeared(dest) from None
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            if os.path.lexists(dest):
                raise _appeared(dest) from None
            staging.rename(data, dest)
        elif not staging.moved(data, dest):
            raise


def undo_half_publish(stage_dir: Path, dest: Path, *, fsync: bool) -> None:
    """After a failed (or interrupted) exchange-less publish, put the previous version back, as
    the directories themselves show it (``staging.phase``). Raises :class:`OperationalError` when
    that cannot be done (``old/`` and ``data/`` are left intact for the next run or gc-tmp, which
    refuses to remove them) or when the directories are in conflict."""
    def left_for_recovery(exc: OSError, what: str) -> OperationalError:
        return OperationalError(
            f"publishing {dest} failed half-way, and {what} ({exc.strerror or exc}); nothing was deleted",
            f"run `ckptctl gc-tmp {dest.parent} --min-age 0` (or this command again) once the storage "
            "answers: it finishes the publish from the staging directory", phase="publish")

    try:
        state = staging.phase(stage_dir)
    except OSError as exc:
        raise left_for_recovery(exc, f"{stage_dir} cannot be read to tell how far it got") from None
    if state is staging.State.CONFLICT:
        raise OperationalError(*staging.conflict_message(dest, stage_dir), phase="publish")
    if state.half_published:
        try:
            staging.roll(stage_dir, dest, forward=False, fsync=fsync)
        except OSError as exc:
            raise left_for_recovery(exc, f"the previous version could not be put back from "
                                         f"{stage_dir / staging.OLD}") from None
