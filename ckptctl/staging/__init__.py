"""Staging directories: the on-disk contract between writers (publish) and gc-tmp.

A staging directory is a sibling of the destination on the same filesystem, named by
``ckptctl.format.names.staging_name``::

    <parent>/_tmp_<name>.<stamp>-<rand>/
        owner.json     who writes here: pid, host, boot id, process start time, tool version,
                       command, destination name, creation time
        lock           flock(LOCK_EX) held by the writer for its whole life
        data/          the checkpoint being built; published by renaming it onto <parent>/<name>
        ready          present once data/ is complete and fsynced (publish may roll forward)
        old/           during an exchange-less publish: the previous version moved aside

Modules: ``record`` (entry names, owner record, siblings), ``lock`` (the one flock: acquire,
probe, release), ``liveness`` (is the writer alive), ``state`` (:func:`inspect`: the one state
function), ``actions`` (roll forward/back, remove, recover a destination), ``fs`` (the one
removal, never following links, NFS-aware; fsync).

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
                           held is a writer starting                        (``LockHeldError``)
STUB                       dead; no owner record, nothing inside but        gc-tmp removes it once older than
                           empty ``lock``/``owner.json``                    ``--min-age``; recovery skips it
ABANDONED                  dead; owner record; no ``ready``                 removed (recovery: when the owner ran on
                                                                            this host; gc-tmp: this host past
                                                                            ``--min-age``, other hosts past
                                                                            ``--older-than``)
SEALED                     dead; ``ready`` (regular file); no ``old/``      removed, as ABANDONED. Also what a writer
                           (not published, or published by exchange so      killed after ``RENAME_EXCHANGE`` leaves:
                           ``data/`` holds the old version)                 either way the destination is whole
HALF_PUBLISHED_FORWARD     dead; ``old/`` present, destination absent,      roll forward: ``data/`` renamed onto the
                           ``ready`` regular file, ``data/`` a real dir     destination, parent fsynced; then removed
HALF_PUBLISHED_BACK        dead; ``old/`` present, destination absent,      roll back: ``old/`` renamed onto the
                           not sealed (or ``data/`` missing / a link)       destination, parent fsynced; then removed
PUBLISHED_LEFTOVER         dead; ``old/`` present and the destination too   removed (``old/`` is the superseded
                           (the second rename happened)                     version)
=========================  ===============================================  ==========================================

Removing a staging directory (:func:`remove_staging`) is refused while it is half-published
(``old/`` holds the only copy of the destination), whoever asks, including the writer's own
cleanup after a failed publish. It removes everything else first, then the owner record, then
the lock, so an interrupted removal stays recognisable.
"""

from __future__ import annotations

from ckptctl.format.names import parse_staging_name, staging_name
from ckptctl.staging.actions import recover, recover_destination, remove_staging, remove_staging_at, roll
from ckptctl.staging.fs import Deferred, fsync_path, open_beneath, remove_at, remove_tree
from ckptctl.staging.liveness import Liveness, boot_id, judge_owner, on_this_host, process_start_time, process_state
from ckptctl.staging.lock import LOCK, StagingLock, acquire, probe
from ckptctl.staging.record import DATA, OLD, OWNER, READY, TOOL, owner_record, read_owner, siblings
from ckptctl.staging.state import State, StagingState, inspect, is_stub, phase

# ``staging.parse_name`` is what callers outside the package have always called it.
parse_name = parse_staging_name

__all__ = [
    "DATA", "LOCK", "OLD", "OWNER", "READY", "TOOL",
    "Deferred", "Liveness", "StagingLock", "StagingState", "State",
    "acquire", "boot_id", "fsync_path", "inspect", "is_stub", "judge_owner", "on_this_host", "open_beneath",
    "owner_record", "parse_name", "parse_staging_name", "phase", "probe", "process_start_time", "process_state",
    "read_owner", "recover", "recover_destination", "remove_at", "remove_staging", "remove_staging_at",
    "remove_tree", "roll", "siblings", "staging_name",
]
