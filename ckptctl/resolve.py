"""Resolve a command-line path: a local path, a Hugging Face cache repo folder
(``models--org--name/``: the snapshot ``refs/main`` names), or a repo id present in the local HF
cache."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from ckptctl.errors import InputError
from ckptctl.format.small import read_small

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REPO_FOLDER = re.compile(r"^(models|datasets|spaces)--.+")
_MAX_REF = 256  # refs/main holds a 40-hex commit


class Resolved(NamedTuple):
    path: Path
    note: str | None = None  # what was resolved, for the user (a cache folder -> its snapshot)


def resolve_path(text: str) -> Path:
    """A local path as given, or the snapshot directory of a cached repo id (offline)."""
    p = Path(text)
    if p.exists() or p.is_symlink():
        return p
    if _REPO_ID.match(text) and not text.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(text, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            raise InputError(f"{text} is neither a local path nor a repo id in the local Hugging Face cache",
                             f"download it first (`hf download {text}`) or pass a directory") from None
    raise InputError(f"no such file or directory: {text}", "check the path")


def resolve(text: str) -> Resolved:
    """:func:`resolve_path`, where a cache repo folder (``models--org--name/``) stands for one of
    its snapshots (see :func:`cache_snapshot`), with a note saying which. For the commands that
    read one checkpoint (inspect, export); ``verify --recursive`` walks the folder instead."""
    p = resolve_path(text)
    return cache_snapshot(p) or Resolved(p)


def cache_snapshot(p: Path) -> Resolved | None:
    """For a Hugging Face cache repo folder (``models--org--name/`` with ``snapshots/``): the
    snapshot ``refs/main`` names, or the only snapshot; None for any other path. Several
    snapshots and no usable ``refs/main`` is refused with the list to choose from."""
    snaps = p / "snapshots"
    if not (_REPO_FOLDER.match(p.name) and p.is_dir() and snaps.is_dir() and not snaps.is_symlink()):
        return None
    ref = p / "refs" / "main"
    try:  # a regular file, bounded (never a FIFO, a device or a link)
        commit = read_small(ref, limit=_MAX_REF).decode("ascii", "replace").strip()
    except OSError:
        commit = ""
    if commit and "/" not in commit and commit not in (".", "..") and (snaps / commit).is_dir():
        return Resolved(snaps / commit, f"{p.name}: snapshot {commit} (refs/main)")
    found = sorted(n for n in os.listdir(snaps) if (snaps / n).is_dir())
    if len(found) == 1:
        return Resolved(snaps / found[0], f"{p.name}: snapshot {found[0]} (the only one)")
    raise InputError(f"{p} is a Hugging Face cache folder with {len(found)} snapshots and no usable refs/main"
                     + (f": {', '.join(found)}" if found else ""),
                     f"pass one snapshot: {snaps}/<commit>")
