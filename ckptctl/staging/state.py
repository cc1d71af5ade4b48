"""The state of a staging directory, from what is on disk and whether its writer lives.

:func:`inspect` is the one place that decides it; recovery (``recover_destination``), gc-tmp's
dry run and gc-tmp's removal all act on its result (the table is in the package docstring).
"""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptctl.format.names import parse_staging_name
from ckptctl.staging.fs import listing
from ckptctl.staging.liveness import Liveness, judge_owner
from ckptctl.staging.lock import LOCK
from ckptctl.staging.record import DATA, OLD, OWNER, READY, read_journal, read_owner


class State(enum.Enum):
    NOT_OURS = "not-ours"
    WRITING = "writing"
    STUB = "stub"
    ABANDONED = "abandoned"
    SEALED = "sealed"
    HALF_PUBLISHED_FORWARD = "half-published-forward"
    HALF_PUBLISHED_BACK = "half-published-back"
    PUBLISHED_LEFTOVER = "published-leftover"
    CONFLICT = "conflict"

    @property
    def recovery(self) -> str | None:
        """What recovery does before the directory may go: 'roll-forward', 'roll-back' or None."""
        return _RECOVERY.get(self)

    @property
    def half_published(self) -> bool:
        """The destination is missing and ``old/`` holds the only copy of its previous version."""
        return self in _RECOVERY

    @property
    def protected(self) -> bool:
        """``old/`` (and ``data/``) may hold the only copy of a version: the directory is never
        removed, whoever asks."""
        return self.half_published or self is State.CONFLICT


_RECOVERY = {State.HALF_PUBLISHED_FORWARD: "roll-forward", State.HALF_PUBLISHED_BACK: "roll-back"}


@dataclass(frozen=True)
class StagingState:
    path: Path
    state: State
    owner: dict[str, Any] | None
    live: Liveness
    dest: Path | None  # <parent>/<name> from the directory name (None: not a staging name)


def is_stub(path: Path) -> bool:
    """An empty staging stub: a writer killed between mkdir and writing its owner record, or a
    removal interrupted at its last step. It holds nothing but empty regular ``lock``/``owner.json``."""
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.name not in (LOCK, OWNER):
                    return False
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_size:
                    return False
    except OSError:
        return False
    return True


def _same(entry: os.DirEntry[str], journal: dict[str, Any], key: str) -> bool:
    """Is ``entry`` the directory the journal recorded as ``key`` ('previous' or 'new')? By inode
    number: the device number changes when the filesystem is mounted again."""
    return journal[key] is not None and entry.stat(follow_symlinks=False).st_ino == journal[key]["ino"]


def phase(path: Path) -> State:
    """How far the publish got, from the disk alone (whoever the writer is and whether it lives):
    ABANDONED, SEALED, HALF_PUBLISHED_FORWARD, HALF_PUBLISHED_BACK, PUBLISHED_LEFTOVER or CONFLICT.

    Decided from the directories themselves (``fs.listing``), never from the kernel's name cache,
    and from this directory's own facts only (never from its siblings or their order):

    - no ``old/``: SEALED (``ready`` a regular file) or ABANDONED;
    - ``old/`` that is not the destination directory the journal (in ``ready``) recorded before
      the first rename: CONFLICT (never rolled back, never removed);
    - ``old/`` and no ``data/``: ``data/`` became the destination, so the publish completed and
      ``old/`` is superseded: PUBLISHED_LEFTOVER, whatever is at the destination now;
    - ``old/``, ``data/`` and something at the destination: the second rename never happened and
      the destination is not ours: CONFLICT;
    - ``old/``, ``data/``, no destination: FORWARD when sealed and ``data/`` is the real
      directory the journal recorded, else BACK.

    Raises OSError when the directory (or, when it matters, its parent) cannot be read."""
    names = listing(path)
    ready, old, data = names.get(READY), names.get(OLD), names.get(DATA)
    sealed = ready is not None and ready.is_file(follow_symlinks=False)
    parsed = parse_staging_name(path.name)
    if old is None or parsed is None:
        return State.SEALED if sealed else State.ABANDONED
    journal = read_journal(path) if sealed else None
    if journal is not None and not _same(old, journal, "previous"):
        return State.CONFLICT
    if data is None:
        return State.PUBLISHED_LEFTOVER
    if parsed[0] in listing(path.parent):
        return State.CONFLICT
    if sealed and data.is_dir(follow_symlinks=False) and (journal is None or _same(data, journal, "new")):
        return State.HALF_PUBLISHED_FORWARD
    return State.HALF_PUBLISHED_BACK


def inspect(path: Path, *, locked: bool = False) -> StagingState:
    """The state of the staging directory ``path``. ``locked``: the caller holds its lock (so the
    lock says nothing about the writer; the owner record does).

    NOT_OURS (no valid owner record and not an empty stub) wins over everything; then a live writer
    (WRITING); then a dead writer's STUB or :func:`phase`. Liveness is judged for every state (a
    not-ours directory's lock may be held too). Raises OSError only when a dead writer's entries
    cannot be examined."""
    parsed = parse_staging_name(path.name)
    dest = path.parent / parsed[0] if parsed else None
    owner = read_owner(path) if parsed else None
    live = judge_owner(path, owner, locked=locked)
    if parsed is None or (owner is None and not is_stub(path)):
        state = State.NOT_OURS
    elif live.alive:
        state = State.WRITING
    elif owner is None:
        state = State.STUB
    else:
        state = phase(path)
    return StagingState(path, state, owner, live, dest)
