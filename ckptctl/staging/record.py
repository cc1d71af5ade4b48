"""What a staging directory holds, by name, its owner record and its publish journal.

The directory name itself (``_tmp_<dest>.<stamp>-<rand>``) is a file-name rule and lives in
:mod:`ckptctl.format.names` (``staging_name``, ``parse_staging_name``, ``STAGING_PREFIX``).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ckptctl._version import __version__
from ckptctl.format import small
from ckptctl.format.names import parse_staging_name

OWNER = "owner.json"  # who writes here (the record below)
DATA = "data"  # the checkpoint being built
READY = "ready"  # written and fsynced once data/ is complete; holds the publish journal
OLD = "old"  # during an exchange-less publish: the previous version, moved aside
TOOL = "ckptctl"

MAX_OWNER_BYTES = 1 << 16


def owner_record(dest: Path, command: str | None = None) -> dict[str, Any]:
    """The owner record of a writer for ``dest`` that is this process."""
    from ckptctl.staging.liveness import boot_id, host_name, process_start_time  # (a writer's: the rest reads)

    pid = os.getpid()
    return {
        "tool": TOOL,
        "tool_version": __version__,
        "pid": pid,
        "host": host_name(),
        "boot_id": boot_id(),
        "start_time": process_start_time(pid),
        "created": time.time(),
        "dest": dest.name,
        "command": command if command is not None else command_line(),
    }


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line as a shell would take it again (quoted by ``shlex``), the
    program shown as ``ckptctl`` when it is ckptctl (the console script or ``python -m ckptctl``):
    what gc-tmp and a human read in a leftover's owner record."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return TOOL
    program = argv[0].replace(os.sep, "/")
    if os.path.basename(program) == TOOL or program.endswith(f"{TOOL}/__main__.py"):
        return shlex.join([TOOL, *argv[1:]])
    return shlex.join(argv)


def _read_record(path: Path) -> dict[str, Any] | None:
    """A small JSON document of ours (``"tool": "ckptctl"``), or None when it is missing,
    unreadable, not a regular file, not JSON (or nested too deeply) or not ours. Read by
    :mod:`ckptctl.format.small` without following a link or blocking on a FIFO, up to 64 KiB: a
    link, a FIFO or a huge file put in its place is not a record."""
    try:
        doc = small.read_json(path, limit=MAX_OWNER_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("tool") != TOOL:
        return None
    return doc


def read_owner(staging: Path) -> dict[str, Any] | None:
    """The owner record, or None when it is missing, unreadable, not a regular file or not ours."""
    return _read_record(staging / OWNER)


def journal_record(dest: Path, data: Path) -> dict[str, Any]:
    """The publish journal, written into ``ready`` when ``data/`` is sealed (before any rename):
    the identity (device, inode) of the destination's directory, which an exchange-less publish
    moves to ``old/`` (None when there is no destination), and of ``data/``, which becomes the
    destination. Raises OSError when they cannot be examined."""
    try:
        prev = os.lstat(dest)
    except FileNotFoundError:
        prev = None
    new = os.lstat(data)
    return {"tool": TOOL, "dest": dest.name, "sealed": time.time(),
            "previous": {"dev": prev.st_dev, "ino": prev.st_ino} if prev is not None else None,
            "new": {"dev": new.st_dev, "ino": new.st_ino}}


def read_journal(staging: Path) -> dict[str, Any] | None:
    """The publish journal in ``ready``, or None when there is none (a ``ready`` of an older
    ckptctl, or not a valid journal)."""
    doc = _read_record(staging / READY)
    if doc is None:
        return None
    try:
        if doc["previous"] is not None:
            int(doc["previous"]["ino"])
        int(doc["new"]["ino"])
    except (KeyError, TypeError, ValueError):
        return None
    return doc


def siblings(parent: Path, dest_name: str) -> list[Path]:
    """The staging directories (by name) of ``<parent>/<dest_name>``; none when unreadable."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    out = []
    for n in names:
        parsed = parse_staging_name(n)
        if parsed and parsed[0] == dest_name:
            out.append(parent / n)
    return out
