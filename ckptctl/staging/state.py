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
from ckptctl.staging.fs import lexists
from ckptctl.staging.liveness import Liveness, judge_owner
from ckptctl.staging.lock import LOCK
from ckptctl.staging.record import DATA, OLD, OWNER, READY, read_owner


class State(enum.Enum):
    NOT_OURS = "not-ours"
    WRITING = "writing"
    STUB = "stub"
    ABANDONED = "abandoned"
    SEALED = "sealed"
    HALF_PUBLISHED_FORWARD = "half-published-forward"
    HALF_PUBLISHED_BACK = "half-published-back"
    PUBLISHED_LEFTOVER = "published-leftover"

    @property
    def recovery(self) -> str | None:
        """What recovery does before the directory may go: 'roll-forward', 'roll-back' or None."""
        return _RECOVERY.get(self)

    @property
    def half_published(self) -> bool:
        """The destination is missing and ``old/`` holds the only copy of its previous version."""
        return self in _RECOVERY


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


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def phase(path: Path) -> State:
    """How far the publish got, from the disk alone (whoever the writer is and whether it lives):
    ABANDONED, SEALED, HALF_PUBLISHED_FORWARD, HALF_PUBLISHED_BACK or PUBLISHED_LEFTOVER.

    ``ready`` must be a regular file and ``data/`` a real directory (never a link) to roll forward.
    Raises OSError when an entry cannot be examined (never read as absent)."""
    sealed = _is_regular(path / READY)
    parsed = parse_staging_name(path.name)
    if lexists(path / OLD) and parsed is not None:
        if lexists(path.parent / parsed[0]):
            return State.PUBLISHED_LEFTOVER  # the second rename happened: old/ is superseded
        if sealed and _is_real_dir(path / DATA):
            return State.HALF_PUBLISHED_FORWARD
        return State.HALF_PUBLISHED_BACK
    return State.SEALED if sealed else State.ABANDONED


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
