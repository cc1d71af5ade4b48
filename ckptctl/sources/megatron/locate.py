"""Whether a path is a Megatron-core ``torch_dist`` checkpoint (a ``--save`` root with the tracker,
or an iteration folder), from names and small files alone: the registry's cheap probe
(``sources/kinds.py``), which imports nothing of the reader."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from ckptctl.errors import InputError
from ckptctl.format import names as N
from ckptctl.format.small import TooLarge, read_small
from ckptctl.sources.kinds import dir_names

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
META_JSON = "metadata.json"
_ITER = re.compile(r"^iter_([0-9]{7,})$")


class MegatronLocation(NamedTuple):
    """A Megatron checkpoint: the iteration folder read, and the ``--save`` root (or None)."""

    folder: Path
    root: Path | None
    iteration: str  # as the tracker or the folder name says it (``7``, ``release``)


def _tracker(path: Path) -> str | None:
    """The iteration in a tracker file (one short line), or None when it is not one."""
    try:
        raw = read_small(path, limit=4096)
    except (OSError, TooLarge):
        return None
    try:
        text = raw.decode().strip()
    except UnicodeDecodeError:
        return None
    return text if text and "\n" not in text else None


def is_iteration_folder(names: list[str]) -> bool:
    """Whether a folder listing is one of a Megatron ``torch_dist`` save."""
    return N.DCP_METADATA in names and (COMMON in names or META_JSON in names)


def find_megatron(p: Path) -> MegatronLocation | None:
    """The Megatron checkpoint at ``p`` (a ``--save`` root with the tracker, or an iteration
    folder), or None when ``p`` is none. Raises InputError when the tracker names an iteration
    that is not there."""
    names = dir_names(p)
    if names is None:
        return None
    if is_iteration_folder(names) and (_ITER.match(p.name) or p.name == "release" or COMMON in names):
        if COMMON not in names and not _is_megatron_json(p / META_JSON):
            return None
        m = _ITER.match(p.name)
        return MegatronLocation(p, None, str(int(m.group(1))) if m else p.name)
    if TRACKER not in names:
        return None
    it = _tracker(p / TRACKER)
    iters = sorted(n for n in names if _ITER.match(n) or n == "release")
    if it is None:
        raise InputError(f"{p / TRACKER} does not name an iteration",
                         f"pass an iteration folder instead (present: {', '.join(iters[:5]) or 'none'})")
    digits = it.isascii() and it.isdigit()  # str.isdigit alone takes "²", which int() refuses
    folder_name = "release" if it == "release" else (f"iter_{int(it):07d}" if digits else None)
    if folder_name is None or folder_name not in names or not (p / folder_name).is_dir():
        raise InputError(f"{p / TRACKER} names iteration {it!r}, whose folder is not in {p}",
                         f"pass an iteration folder instead (present: {', '.join(iters[:5]) or 'none'}), "
                         "or copy the missing iteration")
    return MegatronLocation(p / folder_name, p, it)


def _is_megatron_json(path: Path) -> bool:
    try:
        return b'"sharded_backend"' in read_small(path, limit=1 << 16)
    except (OSError, TooLarge):
        return False


