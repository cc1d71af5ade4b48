"""The saves a training job's output directory holds, in step order, each with its fingerprint.

A save is one folder the trainer writes per checkpoint; its kind is decided from the directory's
names alone, at every pass (an empty directory becomes a kind when its first save appears):

============  =================================================  ==================================
kind          the directory (``SAVE_DIR``)                       a save, and what is exported
============  =================================================  ==================================
megatron      Megatron-LM's ``--save``: the tracker              ``iter_NNNNNNN/`` (``release/`` has
              ``latest_checkpointed_iteration.txt`` and          no step: not followed)
              ``iter_NNNNNNN/`` folders
trainer       an HF Trainer ``output_dir``: ``checkpoint-N/``    ``checkpoint-N/``; with DeepSpeed
                                                                 inside (``latest``, ``global_stepN``)
                                                                 it is the ZeRO root the export reads
zero          a DeepSpeed root: ``latest`` and                   ``global_stepN/``
              ``global_stepN/`` folders
dcp           a folder of torch DCP step folders                 each ``<prefix><N>/`` holding
              (``step-N/``, ``step_N/``, ``N/``)                 ``.metadata`` (or its temporary)
============  =================================================  ==================================

Saves are ordered by their integer step, never by their names' text (``checkpoint-1000`` after
``checkpoint-999``); two saves of one step are ordered by name. :func:`fingerprint` lists a save's
files (never following a link, bounded) with sizes and modification times: what "nothing
changed" is measured by (completion's quiet period, the pin of an export).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's (sources/megatron/locate.py names it too)
LATEST = "latest"  # DeepSpeed's tag file
DCP_METADATA = ".metadata"
MAX_FILES = 200_000  # entries a fingerprint lists at most: a save holding more is refused
MAX_DEPTH = 8

_PATTERNS = {
    "megatron": re.compile(r"^iter_([0-9]{7,})$"),
    "trainer": re.compile(r"^checkpoint-([0-9]+)$"),
    "zero": re.compile(r"^global_step([0-9]+)$"),
    "dcp": re.compile(r"^(?:.*?[^0-9])?([0-9]+)$"),
}
KINDS = tuple(_PATTERNS)


@dataclass(frozen=True)
class Save:
    """One save of the followed directory."""

    kind: str  # megatron | trainer | zero | dcp
    name: str  # its folder name: the export is published as DST_ROOT/<name>
    step: int
    path: Path  # the folder, which is also what a plain `ckptctl export` of this save reads

    def sort_key(self) -> tuple[int, str]:
        return (self.step, self.name)


@dataclass
class Fingerprint:
    """A save's files as listed now: relative path -> (size, mtime_ns, type); the newest
    modification time of any entry (directories included: a file created, renamed or removed
    changes its directory's); and the digest of all of it."""

    files: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    newest_ns: int = 0
    digest: str = ""
    total_bytes: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"files": len(self.files), "bytes": self.total_bytes, "digest": self.digest}


# The file each kind writes last (or, for ZeRO, rank 0's model states): a save written again
# changes it, so a handled save whose folder and marker did not change is not listed again.
MARKERS = {"dcp": (DCP_METADATA,), "megatron": (DCP_METADATA,), "trainer": ("trainer_state.json",),
           "zero": ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")}


def quick_key(save: Save) -> tuple | None:
    """Two or three stats: the folder's and its marker's (inode, size, mtime, ctime); None when
    the folder is gone."""
    out: list[tuple[int, int, int, int] | None] = []
    base = os.fspath(save.path)
    for rel in (".", *MARKERS[save.kind]):
        try:
            st = os.stat(f"{base}/{rel}", follow_symlinks=False)
        except FileNotFoundError:
            if rel == ".":
                return None
            out.append(None)
            continue
        except OSError:
            return None
        out.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


class TooManyFiles(OSError):
    """A save holds more entries than :data:`MAX_FILES`."""


def root_kind(names: list[str]) -> str | None:
    """The kind of a followed directory from its entry names (None: no save yet)."""
    if TRACKER in names or any(_PATTERNS["megatron"].match(n) for n in names):
        return "megatron"
    if any(_PATTERNS["trainer"].match(n) for n in names):
        return "trainer"
    if LATEST in names and any(_PATTERNS["zero"].match(n) for n in names):
        return "zero"
    return "dcp" if names else None


def list_saves(root: Path, known: frozenset[str] | set[str] | dict = frozenset()) -> tuple[str | None, list[Save]]:
    """The kind of ``root`` and its saves, by step. Entries that are not directories (a link to a
    folder elsewhere included: never followed) are not saves. ``known``: names already known to be
    saves (a DCP folder's probe is skipped for them). Raises OSError when ``root`` cannot be
    listed."""
    with os.scandir(root) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    kind = root_kind([n for n, _ in entries])
    if kind is None:
        return None, []
    pattern = _PATTERNS[kind]
    saves = []
    for name, is_dir in entries:
        m = pattern.match(name)
        if not is_dir or m is None or name.startswith("."):
            continue
        if kind == "dcp" and name not in known and not _dcp_folder(root / name):
            continue
        saves.append(Save(kind, name, int(m.group(1)), root / name))
    saves.sort(key=Save.sort_key)
    return kind, saves


def _dcp_folder(p: Path) -> bool:
    """A DCP step folder (or one being written): ``.metadata``, its temporary or a ``.distcp``."""
    try:
        with os.scandir(p) as it:
            return any(e.name in (DCP_METADATA, DCP_METADATA + ".tmp") or e.name.endswith(".distcp") for e in it)
    except OSError:
        return False


def fingerprint(path: Path) -> Fingerprint:
    """Every entry below ``path`` (links listed as links, never followed; at most
    :data:`MAX_DEPTH` levels and :data:`MAX_FILES` entries). Raises OSError when ``path`` cannot
    be read (FileNotFoundError: the save is gone)."""
    fp = Fingerprint()
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(20, "not a directory", str(path))
    fp.newest_ns = st.st_mtime_ns
    _walk(path, "", fp, 0)
    h = hashlib.sha256()
    for rel in sorted(fp.files):
        size, mtime, kind = fp.files[rel]
        h.update(f"{rel}\0{size}\0{mtime}\0{kind}\n".encode("utf-8", "surrogateescape"))
    fp.digest = h.hexdigest()
    return fp


def _walk(path: Path, prefix: str, fp: Fingerprint, depth: int) -> None:
    with os.scandir(path) as it:
        entries = list(it)
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while listed: the next look sees the change
        rel = prefix + e.name
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
        fp.files[rel] = (st.st_size if kind == "file" else 0, st.st_mtime_ns, kind)
        if len(fp.files) > MAX_FILES:
            raise TooManyFiles(27, f"more than {MAX_FILES} entries", str(path))
        fp.newest_ns = max(fp.newest_ns, st.st_mtime_ns)
        if kind == "file":
            fp.total_bytes += st.st_size
        elif kind == "dir" and depth < MAX_DEPTH:
            try:
                _walk(Path(e.path), rel + "/", fp, depth + 1)
            except FileNotFoundError:
                continue
