"""Staging directories: naming, owner record, lock. Shared by the writer (publish) and gc-tmp.

A staging directory is a sibling of the destination on the same filesystem::

    <parent>/_tmp_<name>.<stamp>-<rand>/
        owner.json     who writes here: pid, host, boot id, process start time, tool version,
                       command, destination name, creation time
        lock           flock(LOCK_EX) held by the writer for its whole life
        data/          the checkpoint being built; published by renaming it onto <parent>/<name>
        ready          present once data/ is complete and fsynced (publish may roll forward)
        old/           during an exchange-less publish: the previous version moved aside

Everything a dead writer leaves behind is one such directory. ``gc-tmp`` recognises it by its
name *and* its owner record, proves the writer dead (lock free; same host: pid gone or reused),
and rolls a half-done exchange-less publish forward or back before removing anything.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptctl._version import __version__

PREFIX = "_tmp_"
OWNER = "owner.json"
LOCK = "lock"
DATA = "data"
READY = "ready"
OLD = "old"
TOOL = "ckptctl"

# _tmp_<name>.<stamp>-<rand>: stamp is hex nanoseconds since the epoch (orders writers by start).
NAME_RE = re.compile(r"^_tmp_(?P<dest>.+)\.(?P<stamp>[0-9a-f]{16})-(?P<rand>[0-9a-f]{8})$")


def staging_name(dest_name: str) -> str:
    return f"{PREFIX}{dest_name}.{time.time_ns():016x}-{secrets.token_hex(4)}"


def parse_name(name: str) -> tuple[str, int] | None:
    """(destination name, start stamp) of a staging directory name, or None."""
    m = NAME_RE.match(name)
    if not m:
        return None
    return m.group("dest"), int(m.group("stamp"), 16)


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and ')')."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split() or None


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _proc_state(pid: int) -> str | None:
    """R, S, D, T, Z, ... (field 3 of /proc/PID/stat)."""
    fields = _proc_stat(pid)
    return fields[0] if fields else None


def owner_record(dest: Path, command: str | None = None) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "tool": TOOL,
        "tool_version": __version__,
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "start_time": process_start_time(pid),
        "created": time.time(),
        "dest": dest.name,
        "command": command if command is not None else " ".join(sys.argv),
    }


def read_owner(staging: Path) -> dict[str, Any] | None:
    """The owner record, or None when it is missing, unreadable or not ours."""
    try:
        with open(staging / OWNER, "rb") as f:
            raw = f.read(1 << 16)
        doc = json.loads(raw)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("tool") != TOOL:
        return None
    return doc


class LockFile:
    """An flock held on ``<staging>/lock`` for the writer's lifetime."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, *, patience: float = 0.0) -> None:
        """Take the lock without blocking; with ``patience`` seconds, retry briefly (a liveness
        probe by gc-tmp or another writer holds it for microseconds)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                    os.close(fd)
                    raise
                time.sleep(0.005)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None


def lock_is_held(staging: Path) -> bool:
    """True when some process holds the staging directory's lock (probing never blocks)."""
    fd = None
    # NFS emulates flock with fcntl locks, whose exclusive form needs a writable descriptor.
    for mode in (os.O_RDWR, os.O_RDONLY):
        try:
            fd = os.open(staging / LOCK, mode | os.O_CLOEXEC)
            break
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            if exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM) or mode == os.O_RDONLY:
                raise
    assert fd is not None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


@dataclass
class Liveness:
    alive: bool
    reason: str


def judge_owner(staging: Path, owner: dict[str, Any] | None) -> Liveness:
    """Is the writer of ``staging`` alive? Lock first; on this host, pid + start time + boot id."""
    if lock_is_held(staging):
        return Liveness(True, "lock held")
    if owner is None:
        return Liveness(False, "no owner record, lock free")
    if owner.get("host") != socket.gethostname():
        return Liveness(False, "lock free (owner on another host)")
    if owner.get("boot_id") and boot_id() and owner["boot_id"] != boot_id():
        return Liveness(False, "owner ran before the last reboot")
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return Liveness(False, "lock free, no pid")
    start = process_start_time(pid)
    if start is None:
        return Liveness(False, f"pid {pid} is gone")
    if _proc_state(pid) == "Z":
        return Liveness(False, f"pid {pid} has exited (zombie, not yet reaped)")
    if owner.get("start_time") is not None and start != owner["start_time"]:
        return Liveness(False, f"pid {pid} now belongs to another process")
    # Same process still running but its lock is free: it is between creating the directory and
    # taking the lock, or it is finishing up. Treat as alive; never race a live writer.
    return Liveness(True, f"pid {pid} still running")
