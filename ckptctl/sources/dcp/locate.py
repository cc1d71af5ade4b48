"""The DCP-HF kind's probe (the registry's ``locate`` hook): whether a path is torch's
HuggingFaceStorageWriter output, decided from names and, for a candidate only, the first shard's
header. Kept apart from the reader (:mod:`ckptctl.sources.dcp.hf`) so that probing a checkpoint of
another kind imports nothing of it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptctl.errors import CkptctlError, InputError, from_oserror
from ckptctl.format import names as N
from ckptctl.format.dcp_hf_names import SHARD_NAME, SHARDED_DIR

SHARDING_KEY = "DCP_SHARDING_INFO"  # the header metadata key of a DCP-HF shard


def regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def safetensors_in(d: Path) -> list[str]:
    try:
        names = os.listdir(d)
    except OSError as exc:
        raise from_oserror(exc, "cannot list the DCP-HF shards") from None
    return sorted(n for n in names if N.is_safetensors(n) and regular(d / n))


def find_sharded(p: Path) -> tuple[bool, Path] | None:
    """``(True, p/sharded)`` when ``p`` is a root that holds a DCP-HF ``sharded/`` directory,
    ``(False, p)`` when ``p`` holds DCP-HF shards itself, else None. Decided from names and, for
    a candidate, the first shard's header (a checkpoint of ordinary names reads nothing)."""
    try:
        if not p.is_dir():
            if SHARD_NAME.fullmatch(p.name) and _has_info(p.parent, p.name):
                raise InputError(f"{p} is one rank's shard of a DCP-HF save (its tensors are partial)",
                                 f"pass the directory that holds every shard: {p.parent}")
            return None
        names = os.listdir(p)
        sub = p / SHARDED_DIR
        if SHARDED_DIR in names and stat.S_ISDIR(os.lstat(sub).st_mode) and _has_info(sub):
            return True, sub
    except OSError:  # the ordinary scan reports what cannot be read
        return None
    if (p.name == SHARDED_DIR or any(SHARD_NAME.fullmatch(n) for n in names)) and _has_info(p):
        return False, p
    return None


def _has_info(d: Path, name: str | None = None) -> bool:
    """Whether the shard ``name`` of ``d`` (by default its first ``shard-*`` file, else its first
    safetensors file) has sharding info in its header."""
    from ckptctl.format.header import read_header

    try:
        if name is None:
            files = safetensors_in(d)
            named = [n for n in files if SHARD_NAME.fullmatch(n)] or files
            if not named:
                return False
            name = named[0]
        hdr = read_header(d / name)
    except CkptctlError:  # unreadable: not recognised here (the ordinary scan says why)
        return False
    return SHARDING_KEY in (hdr.metadata or {})

