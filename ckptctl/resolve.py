"""Resolve a command-line path: a local path, or a repo id present in the local HF cache."""

from __future__ import annotations

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

