"""Staging directories: the on-disk contract between writers (publish) and gc-tmp.

A staging directory is a sibling of the destination on the same filesystem, named by
``ckptctl.format.names.staging_name``::

    <parent>/_tmp_<name>.<stamp>-<rand>/
        owner.json     who writes here: pid, host, boot id, process start time, tool version,
                       command, destination name, creation time
        lock           flock(LOCK_EX) held by the writer for its whole life
        data/          the checkpoint being built; published by renaming it onto <parent>/<name>
        ready          present once data/ is complete and fsynced (publish may roll forward);
                       it holds the publish journal, written and fsynced before any rename: the
                       identity (device, inode) of the destination's directory (which an
                       exchange-less publish moves to old/) and of data/ (which becomes the
                       destination)
        old/           during an exchange-less publish: the previous version moved aside

Modules: ``record`` (entry names, owner record, journal, siblings), ``lock`` (the one flock:
acquire, probe, release), ``liveness`` (is the writer alive), ``state`` (:func:`inspect`: the one
state function), ``actions`` (roll forward/back, remove, recover a destination), ``fs`` (the one
removal, never following links, NFS-aware; fsync; the uncached directory listing and the checked
rename that survive a lost reply), ``keep`` (what a replaced destination keeps: files that
appeared in it while we wrote, its permissions).

Every decision about ``old/``, ``data/`` and the destination is made from the directories
themselves (``fs.listing``: ``getdents``, which NFS revalidates and FUSE always asks the
filesystem for), never from the kernel's name cache, and from the directory's own facts only:
never from which sibling comes first.

States (:class:`State`), in the order :func:`inspect` decides them. "Dead" means the lock is
free and, on the owner's host, its pid is gone, reused, a zombie or from before the last reboot
(``liveness.judge_owner``); a lock that cannot be probed counts as held.

=========================  ===============================================  ==========================================
state                      how it is recognised                             what recovery / gc-tmp does
=========================  ===============================================  ==========================================
NOT_OURS                   staging name, but no valid ckptctl owner         nothing: gc-tmp lists it ``unknown`` and
                           record and not an empty stub                     keeps it (``--preset miles`` takes it by
                                                                            age); recovery skips it
WRITING                    the writer is alive (lock held, or its pid       nothing, whatever its age; a later writer
                           still runs on this host); a stub whose lock is   for the same destination refuses
                           held is a writer starting                        (``LockHeldError``), at the latest when
                                                                            it stages, at once when the live writer
                                                                            is between its two renames (recovery)
STUB                       dead; no owner record, nothing inside but        gc-tmp removes it once older than
                           empty ``lock``/``owner.json``                    ``--min-age``; recovery skips it
ABANDONED                  dead; owner record; no ``ready``                 removed (recovery: when the owner ran on
                                                                            this host; gc-tmp: this host past
                                                                            ``--min-age``, other hosts past
                                                                            ``--older-than``)
SEALED                     dead; ``ready`` (regular file); no ``old/``      removed, as ABANDONED. Also what a writer
                           (not published, or published by exchange so      killed after ``RENAME_EXCHANGE`` leaves:
                           ``data/`` holds the old version)                 either way the destination is whole
CONFLICT                   dead; ``old/`` is not the directory the          nothing, ever: kept and reported (gc-tmp:
                           journal recorded as the destination's; or        kept with an error, exit 3; recovery:
                           ``old/`` and ``data/`` present and something     refuses to write the destination) until
                           else at the destination (it appeared between     a human moves the intruder aside (then it
                           the two renames)                                 is HALF_PUBLISHED_FORWARD)
PUBLISHED_LEFTOVER         dead; ``old/`` present, ``data/`` absent         removed (``old/`` is the superseded
                           (``data/`` became the destination: the publish   version: never rolled back, even when the
                           completed), whatever is at the destination       destination is missing now)
HALF_PUBLISHED_FORWARD     dead; ``old/`` and ``data/`` present,            roll forward: ``data/`` renamed onto the
                           destination absent, ``ready`` regular file,      destination, parent fsynced; then removed
                           ``data/`` the real directory the journal names
HALF_PUBLISHED_BACK        dead; ``old/`` and ``data/`` present,            roll back: ``old/`` renamed onto the
                           destination absent, not sealed (or ``data/`` a   destination, parent fsynced; then removed
                           link or not the journal's)
=========================  ===============================================  ==========================================

The journal (in ``ready``) makes ``old/`` attributable: with one, ``old/`` is acted on only when its
inode is the one the destination had when ``data/`` was sealed, before the first rename (the
device number is not compared: it changes when the filesystem is mounted again). Without one (a
``ready`` of an older ckptctl) the same rules apply minus that check.

Removing a staging directory (:func:`remove_staging`) is refused while its state is protected
(half-published or CONFLICT: ``old/`` may hold the only copy of a version), whoever asks,
including the writer's own cleanup after a failed publish. It removes everything else first,
then the owner record and the lock (closed before it is unlinked, so no silly-renamed lock keeps
the directory), so an interrupted removal stays recognisable. No removal (the writer's cleanup,
gc-tmp, resave) ever crosses a mount point (``staging.mounts``): an entry on another mount than
its directory raises :class:`MountInside` and the mounted filesystem is left as it is.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ckptctl.format.names import parse_staging_name, staging_name

# Each name this package offers -> its module, imported when the name is first asked for (a
# command that finds no staging directory imports none of them: liveness, state, locks, about 5 ms).
_FROM = {
    "actions": ("competitor_error", "conflict_message", "recover", "remove_staging", "remove_staging_at", "roll"),
    "fs": ("Deferred", "fsync_path", "listing", "moved", "open_beneath", "remove_at", "remove_tree", "rename",
           "write_small"),
    "liveness": ("Liveness", "boot_id", "judge_owner", "on_this_host", "open_elsewhere", "process_start_time",
                 "process_state"),
    "lock": ("LOCK", "NotALock", "StagingLock", "acquire", "probe"),
    "mounts": ("MountInside", "is_mount_point", "mounts_below"),
    "record": ("DATA", "OLD", "OWNER", "READY", "TOOL", "journal_record", "owner_record", "read_journal",
               "read_owner", "siblings"),
    "state": ("State", "StagingState", "inspect", "is_stub", "phase"),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

# ``staging.parse_name`` is what callers outside the package have always called it.
parse_name = parse_staging_name


def recover_destination(dest: Path) -> list[str]:
    """:func:`ckptctl.staging.actions.recover_destination`, imported only when ``dest``'s parent
    holds a staging directory of its name (``record.siblings``); else nothing to recover: ``[]``."""
    from ckptctl.staging.record import siblings

    if not siblings(dest.parent, dest.name):
        return []
    from ckptctl.staging.actions import recover_destination as recover

    return recover(dest)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted([*_MODULE_OF, "parse_name", "parse_staging_name", "recover_destination", "staging_name"])
