"""The follower's state, on disk in ``DST_ROOT/.ckptctl-follow/`` (never in memory only).

::

    DST_ROOT/.ckptctl-follow/
        lock            flock(LOCK_EX) held by the one follower of DST_ROOT for its whole life
        holder.json     who holds it: pid, host, boot id, process start time, command, since when
        follow.json     what is followed: the source directory, --from, and the step below which
                        saves were already there when following began (--from newest)
        saves/<name>.json
                        one record per save handled (below), written whole: a temporary name,
                        fsync, rename, fsync of the folder

A record's ``status``: ``exporting`` (written before the export starts: the destination's
identity before it, so a restart tells a publish that happened from one that did not),
``published``, ``lost`` (the save changed or was deleted while it was exported, or before its
turn: nothing published), ``refused`` (the export refused the save: a damaged or unsupported
save), ``blocked`` (``DST_ROOT/<name>`` holds a directory the follower did not publish), ``waiting``
(seen, not complete), ``released`` (an export of ours someone else replaced), ``skipped``
(older than what was there when following began, with ``--from newest``), ``removing`` and
``removed`` (retention). ``events`` lists what happened to it (bounded).

A second follower of the same ``DST_ROOT`` finds the lock held and is refused (exit 3) with the
holder's record. Temporary record files of a follower killed mid-write are removed by the next
one, which holds the lock: nothing else ever writes there.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from ckptctl.errors import LockHeldError, OperationalError, UsageError, from_oserror
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.staging import StagingLock, acquire, fsync_path
from ckptctl.staging.record import TOOL, owner_record

STATE_DIR = ".ckptctl-follow"
HOLDER = "holder.json"
SETTINGS = "follow.json"
SAVES = "saves"
RECORD_SCHEMA = 1
MAX_EVENTS = 32
MAX_RECORD_BYTES = 1 << 20
FINAL = ("published", "refused", "skipped", "removing", "removed", "released")  # a save in one of these is handled


class FollowState:
    """The state directory of one ``DST_ROOT``, locked by this process (:meth:`open`)."""

    def __init__(self, dst_root: Path, lock: StagingLock, *, fsync: bool = True) -> None:
        self.root = dst_root
        self.dir = dst_root / STATE_DIR
        self.saves_dir = self.dir / SAVES
        self.lock: StagingLock | None = lock
        self.fsync = fsync
        self.settings: dict[str, Any] = {}
        self.records: dict[str, dict[str, Any]] = {}  # a write-through copy of saves/*.json

    @classmethod
    def open(cls, dst_root: Path, *, source: Path, start_from: str, command: str, fsync: bool = True) -> FollowState:
        """Lock ``dst_root``'s state (created when missing) and read it. Raises
        :class:`LockHeldError` naming the holder when another follower has it, and
        :class:`UsageError` when the state follows another source directory."""
        state_dir = dst_root / STATE_DIR
        _own_directory(state_dir)
        _own_directory(state_dir / SAVES)
        try:
            os.makedirs(state_dir / SAVES, exist_ok=True)
            lock = acquire(state_dir)
        except OSError as exc:
            raise from_oserror(exc, f"cannot lock the follower's state in {state_dir}") from None
        if lock is None:
            raise _held(dst_root, state_dir)
        self = cls(dst_root, lock, fsync=fsync)
        try:
            self._clean_temporaries()
            self.write_json(self.dir / HOLDER, {**owner_record(dst_root, command), "since": time.time()})
            self._settings(source, start_from)
            self._read_records()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Let go of the lock (holder.json stays: the next holder rewrites it)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---------------------------------------------------------------------------------------
    def _settings(self, source: Path, start_from: str) -> None:
        path = self.dir / SETTINGS
        doc = _read(path)
        if doc is None:
            self.settings = {"tool": TOOL, "source": str(source), "from": start_from, "baseline": None,
                             "created": time.time()}
            self.write_json(path, self.settings)
            return
        if doc.get("source") != str(source):
            raise UsageError(f"{self.root} follows {doc.get('source')}, not {source}",
                             f"follow {source} into another DST_ROOT (one DST_ROOT records one source)")
        self.settings = doc

    def set_baseline(self, step: int | None) -> None:
        """Record the step below which saves were already there when following began."""
        self.settings["baseline"] = step
        self.settings["baseline_set"] = True
        self.write_json(self.dir / SETTINGS, self.settings)

    @property
    def baseline_set(self) -> bool:
        return bool(self.settings.get("baseline_set"))

    def _read_records(self) -> None:
        try:
            names = os.listdir(self.saves_dir)
        except OSError as exc:
            raise from_oserror(exc, f"cannot read {self.saves_dir}") from None
        for n in names:
            if n.endswith(".json") and not n.startswith("."):
                doc = _read(self.saves_dir / n, limit=MAX_RECORD_BYTES)
                name = doc.get("name") if doc is not None else None
                if isinstance(name, str) and name + ".json" == n and N.destination_problem(name) is None:
                    # where an export lives is never the record's word: DST_ROOT/<its name> (a record
                    # planted in a shared DST_ROOT must not point retention at another directory)
                    doc["dest"] = str(self.root / name)
                    self.records[name] = doc

    def _clean_temporaries(self) -> None:
        """Remove the temporary record files a killed follower left (``.<name>.<pid>.tmp``)."""
        for d in (self.dir, self.saves_dir):
            for n in os.listdir(d):
                if n.startswith(".") and n.endswith(".tmp"):
                    try:
                        os.unlink(d / n)
                    except FileNotFoundError:
                        pass

    # ---------------------------------------------------------------------------------------
    def put(self, record: dict[str, Any], event: dict[str, Any] | None = None) -> None:
        """Write ``record`` (with ``event`` appended to its events) whole."""
        if event is not None:
            events = record.setdefault("events", [])
            events.append({"at": time.time(), **event})
            del events[:-MAX_EVENTS]
        record.setdefault("tool", TOOL)
        record["schema_version"] = RECORD_SCHEMA
        self.write_json(self.saves_dir / f"{record['name']}.json", record)
        self.records[record["name"]] = record

    def drop(self, name: str) -> None:
        """Forget the record of ``name`` (an export that never published)."""
        self.records.pop(name, None)
        try:
            os.unlink(self.saves_dir / f"{name}.json")
        except FileNotFoundError:
            pass
        if self.fsync:
            fsync_path(self.saves_dir, directory=True)

    def write_json(self, path: Path, doc: dict[str, Any]) -> None:
        """``doc`` at ``path``, whole or not at all: temporary file, fsync, rename, fsync the folder."""
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        data = (json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n").encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            if self.fsync:
                fsync_path(path.parent, directory=True)
        except OSError as exc:
            raise from_oserror(exc, f"cannot record the follower's state in {path}") from None


def _read(path: Path, limit: int = 1 << 16) -> dict[str, Any] | None:
    try:
        doc = small.read_json(path, limit=limit)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise OperationalError(f"the follower's state file {path} is unreadable ({exc})",
                               "move it aside (the follower then treats that save as new)") from None
    return doc if isinstance(doc, dict) and doc.get("tool") == TOOL else None


def holder(dst_root: Path) -> dict[str, Any] | None:
    """The record of the follower holding (or last holding) ``dst_root``'s state."""
    try:
        return _read(dst_root / STATE_DIR / HOLDER)
    except OperationalError:
        return None


def _held(dst_root: Path, state_dir: Path) -> LockHeldError:
    who = holder(dst_root) or {}
    since = who.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return LockHeldError(
        f"{dst_root} is already followed by pid {who.get('pid', '?')} on {who.get('host', '?')} since {when} "
        f"({who.get('command', 'command unknown')})",
        f"one follower per DST_ROOT: stop that one first (kill {who.get('pid', 'PID')}), or follow into another "
        f"directory; its lock is {state_dir / 'lock'}")


def record_read(dst_root: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Without the lock, for a reader (inspect): the settings and every record, by step."""
    state_dir = dst_root / STATE_DIR
    settings = _read(state_dir / SETTINGS)
    out = []
    try:
        names = os.listdir(state_dir / SAVES)
    except OSError:
        names = []
    for n in names:
        if n.endswith(".json") and not n.startswith("."):
            try:
                doc = _read(state_dir / SAVES / n, limit=MAX_RECORD_BYTES)
            except OperationalError:
                continue
            if doc is not None:
                out.append(doc)
    out.sort(key=lambda r: (r.get("step") if isinstance(r.get("step"), int) else -1, str(r.get("name"))))
    return settings, out


def _own_directory(path: Path) -> None:
    """``path`` is absent, or a real directory of this user: never a link (a neighbour's link in a
    shared DST_ROOT would move the follower's state, and what it removes, elsewhere)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise from_oserror(exc, f"cannot read {path}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a link" if stat.S_ISLNK(st.st_mode) else "not a directory" if not stat.S_ISDIR(st.st_mode) \
            else "another user's directory"
        raise OperationalError(f"{path} is {what}: the follower keeps its state only in a directory of its own",
                               f"remove or move {path} away, then start the follower again")
