"""Whether a path is a DeepSpeed ZeRO checkpoint (a root with ``latest``, or a step folder holding
optimizer-states files), from names and the ``latest`` file alone: the registry's cheap probe
(``sources/kinds.py``), which imports nothing of the reader."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

from ckptctl.errors import InputError
from ckptctl.sources.kinds import dir_names

LATEST = "latest"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_TAG = re.compile(r"^[A-Za-z0-9_.+-]{1,200}$")


class ZeroLocation(NamedTuple):
    """Where a ZeRO checkpoint is: its step folder, the root beside it (config, tokenizer) and
    the tag."""

    folder: Path
    root: Path
    tag: str


def find_zero(p: Path) -> ZeroLocation | None:
    """The ZeRO checkpoint at ``p`` (a root with ``latest``, or a step folder holding optimizer
    states files), or None when ``p`` is not one. Raises InputError when ``latest`` names a step
    that is not there."""
    names = dir_names(p)
    if names is None:
        return None
    if any(_OPTIM.match(n) for n in names):
        return ZeroLocation(p, p.parent, p.name)
    if LATEST not in names:
        return None
    tag = _read_latest(p / LATEST)
    if tag is None:
        return None
    steps = [n for n in names if n.startswith("global_step") or n == tag]
    if not steps and "zero_to_fp32.py" not in names:
        return None  # a file named latest in something that is not a DeepSpeed root
    folder = p / tag
    if not _TAG.match(tag) or tag in (".", "..") or not folder.is_dir():
        have = sorted(n for n in names if n.startswith("global_step"))
        raise InputError(f"{p / LATEST} names step {tag!r}, which is not in {p}",
                         f"pass a step folder instead (present: {', '.join(have[:5]) or 'none'}), "
                         "or copy the missing step")
    return ZeroLocation(folder, p, tag)


def _read_latest(path: Path) -> str | None:
    """The tag in a ``latest`` file (one short line), or None when it is not such a file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, 4097)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        text = raw.decode().strip()
    except UnicodeDecodeError:
        return None
    return text if text and len(raw) <= 4096 and "\n" not in text else None


