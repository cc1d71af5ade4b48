"""Resolve a command-line path: a local path, or a repo id present in the local HF cache."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckptctl.errors import InputError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


def ensure_inside(root: Path, name: str) -> Path:
    """``root / name`` if it stays inside root (no absolute path, no '..', no symlink escape)."""
    if not name or os.path.isabs(name) or "\\" in name or any(part == ".." for part in name.split("/")):
        raise InputError(f"{name!r} points outside {root}", "file names in an index must be relative")
    target = root / name
    real_root = os.path.realpath(root)
    real = os.path.realpath(target)
    if os.path.commonpath([real_root, real]) != real_root:
        raise InputError(f"{name!r} resolves outside {root} (through a symlink)", "remove the link")
    return target
