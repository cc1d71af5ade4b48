"""When a save is complete, per kind (docs/FOLLOW.md), and its identity.

A save is complete when three things hold:

1. **its kind's marker** (below) says the trainer finished writing it;
2. **its files are whole**: every file the marker's metadata names is there and long enough, and
   no file is newer than a marker that is written last;
3. **a quiet period**: no entry of the save (files and folders) was modified in the last
   ``quiet`` seconds (and, while following, the fingerprint did not change between two looks).

=========  ==========================================================================================
kind       marker and whole files
=========  ==========================================================================================
dcp        ``.metadata`` present (torch renames it into place last, after every rank's data is
           fsynced), no ``.metadata.tmp``; every storage file it names present and at least as long
           as the furthest byte it reads; no ``.distcp`` newer than ``.metadata`` (``overwrite=True``
           rewrites the data of a step in place while the old ``.metadata`` exists). Identity:
           ``storage_meta.save_id`` (a uuid per save) and ``.metadata``'s size and time.
trainer    ``trainer_state.json`` (the Trainer's last file; it has no marker) parses and its
           ``global_step`` is the folder's step; the weights are there (a single file, an index
           whose shards are all present, an adapter, or a DeepSpeed root judged as ``zero``).
           Identity: ``trainer_state.json``'s sha256, size and time.
megatron   the tracker names this iteration or a later one (Megatron-LM rewrites it after the
           folder's ``.metadata`` and ``metadata.json``, but before the tokenizer files: the quiet
           period covers those); the folder is judged as ``dcp`` and has ``common.pt`` or
           ``metadata.json``. Identity: the iteration and ``.metadata``'s size and time.
zero       ``latest`` (root, or the Trainer's checkpoint folder) names this tag or a later step
           (rank 0 writes it while other ranks may still write); every ``*_model_states.pt`` and
           ``*_optim_states.pt`` is a whole zip (its end-of-central-directory record ends the file:
           a file torch is still writing does not end so), optimizer ranks numbered 0..R-1 without
           a gap. Identity: the tag and every rank file's size and time.
=========  ==========================================================================================
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptctl.follow.saves import DCP_METADATA, LATEST, TRACKER, Fingerprint, Save
from ckptctl.format import small

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt$")
_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_[0-9]+_)?mp_rank_[0-9]+_model_states\.pt$")
_STEP = re.compile(r"([0-9]+)$")
_EOCD = b"PK\x05\x06"
TRAINER_STATE = "trainer_state.json"
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MAX_STATE_BYTES = 64 << 20


@dataclass
class Judgement:
    """Whether a save is complete; if not, why (one line); its identity (marker values)."""

    complete: bool
    reason: str | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    quiet_at_ns: int | None = None  # waiting only for the quiet period: when it ends (wall clock)


def judge(save: Save, fp: Fingerprint, *, now_ns: int, quiet_s: float, cache: Any = None) -> Judgement:
    """The completion of ``save`` whose files are ``fp`` (module docstring); ``cache``: a
    ``metacache.MetadataCache`` (a DCP ``.metadata`` parsed once per version)."""
    identity: dict[str, Any] = {}
    if save.kind == "dcp":
        reason = _dcp(save, fp, identity, cache=cache)
    elif save.kind == "megatron":
        reason = _megatron(save, fp, identity, cache=cache)
    else:
        reason = {"trainer": _trainer, "zero": _zero}[save.kind](save, fp, identity)
    quiet_at = None
    if reason is None and quiet_s > 0:
        quiet_at = fp.newest_ns + int(quiet_s * 1e9)
        if now_ns < quiet_at:
            reason = f"modified less than {quiet_s:g}s ago (the quiet period)"
    return Judgement(reason is None, reason, identity, quiet_at if reason is not None else None)


def _size_time(fp: Fingerprint, rel: str) -> dict[str, int]:
    size, mtime, _ = fp.files[rel]
    return {"size": size, "mtime_ns": mtime}


def _dcp(save: Save, fp: Fingerprint, identity: dict[str, Any], prefix: str = "", cache: Any = None) -> str | None:
    meta = prefix + DCP_METADATA
    if meta not in fp.files:
        return f"no {DCP_METADATA} yet (torch writes it last)"
    if meta + ".tmp" in fp.files:
        return f"{DCP_METADATA}.tmp present: the coordinator is writing the metadata"
    if fp.files[meta][2] != "file":
        return f"{DCP_METADATA} is not a regular file"
    from ckptctl.follow.metacache import read_fresh

    try:
        md = cache.read(save.path / meta) if cache is not None else read_fresh(save.path / meta)
    except OSError as exc:
        return f"{DCP_METADATA} unreadable ({exc.strerror or exc})"
    if md.error is not None:
        return md.error
    meta_mtime = fp.files[meta][1]
    for rel, end in md.needs:
        if not isinstance(rel, str) or "/" in rel or rel in ("", ".", ".."):
            return f"{DCP_METADATA} names a storage file {rel!r} that is not a plain name"
        got = fp.files.get(prefix + rel)
        if got is None or got[2] != "file":
            return f"{rel} named by {DCP_METADATA} is missing"
        if got[0] < end:
            return f"{rel} holds {got[0]:,} bytes, {DCP_METADATA} reads up to {end:,}"
    for rel, (_, mtime, kind) in fp.files.items():
        if kind == "file" and rel.startswith(prefix) and rel.endswith(".distcp") and mtime > meta_mtime:
            return f"{rel} is newer than {DCP_METADATA}: the step is being saved again"
    identity["save_id"] = md.save_id if isinstance(md.save_id, str) else None
    identity["metadata"] = _size_time(fp, meta)
    return None


def _megatron(save: Save, fp: Fingerprint, identity: dict[str, Any], cache: Any = None) -> str | None:
    from ckptctl.format.small import TooLarge, read_small

    try:
        text = read_small(save.path.parent / TRACKER, limit=4096).decode().strip()
    except FileNotFoundError:
        return f"no {TRACKER} yet"
    except (OSError, TooLarge, UnicodeDecodeError):
        return f"{TRACKER} unreadable"
    if not (text.isascii() and text.isdigit()):
        return f"{TRACKER} names {text[:40]!r}, not an iteration" if text else f"{TRACKER} is empty (being rewritten)"
    if int(text) < save.step:
        return f"{TRACKER} names iteration {int(text)}: not yet {save.step}"
    if "common.pt" not in fp.files and "metadata.json" not in fp.files:
        return "no common.pt or metadata.json"
    reason = _dcp(save, fp, identity, cache=cache)
    if reason is not None:
        return reason
    identity.pop("save_id", None)  # Megatron-core's planner caches its plans: the id is not per save
    identity["iteration"] = save.step
    return None


def _trainer(save: Save, fp: Fingerprint, identity: dict[str, Any]) -> str | None:
    if TRAINER_STATE not in fp.files:
        return f"no {TRAINER_STATE} yet (the Trainer writes it last)"
    try:
        raw = small.read_small(save.path / TRAINER_STATE, limit=MAX_STATE_BYTES)
        doc = small.loads(raw)
    except (OSError, ValueError):
        return f"{TRAINER_STATE} is not readable JSON yet"
    step = doc.get("global_step") if isinstance(doc, dict) else None
    if step != save.step:
        return f"{TRAINER_STATE} says global_step {step!r}, not {save.step}"
    if LATEST in fp.files:
        reason = _zero_root(save.path, "", fp, identity)
        if reason is not None:
            return reason
    else:
        reason = _weights(save.path, fp)
        if reason is not None:
            return reason
    identity["trainer_state"] = {**_size_time(fp, TRAINER_STATE), "sha256": hashlib.sha256(raw).hexdigest()}
    return None


def _weights(path: Path, fp: Fingerprint) -> str | None:
    for index in _INDEXES:
        if index in fp.files:
            try:
                doc = small.read_json(path / index)
                shards = set(doc["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return f"{index} is not readable yet"
            missing = sorted(s for s in shards if not isinstance(s, str) or s not in fp.files)
            return f"{index} names {missing[0]!r}, which is missing" if missing else None
    if any(w in fp.files for w in _WEIGHTS):
        return None
    if any(rel.endswith(".safetensors") and "/" not in rel for rel in fp.files):
        return None
    return "no model weights in the checkpoint folder"


def _zero(save: Save, fp: Fingerprint, identity: dict[str, Any]) -> str | None:
    return _zero_root(save.path.parent, save.name, fp, identity, outside=True)


def _zero_root(root: Path, tag_folder: str, fp: Fingerprint, identity: dict[str, Any], *,
               outside: bool = False) -> str | None:
    """A DeepSpeed save: ``latest`` in ``root`` names a step at least the save's; the tag folder's
    rank files are whole. ``outside``: ``fp`` lists the tag folder itself (a DeepSpeed root's
    ``global_stepN``), else the folder holding ``latest`` (a Trainer checkpoint)."""
    from ckptctl.format.small import TooLarge, read_small

    try:
        tag = read_small(root / LATEST, limit=4096).decode().strip()
    except FileNotFoundError:
        return f"no {LATEST} yet"
    except (OSError, TooLarge, UnicodeDecodeError):
        return f"{LATEST} unreadable"
    if not tag or "/" in tag or tag in (".", ".."):
        return f"{LATEST} is empty or not a tag"
    if outside:
        m, mine = _STEP.search(tag), _STEP.search(tag_folder)
        if tag != tag_folder and (m is None or mine is None or int(m.group(1)) < int(mine.group(1))):
            return f"{LATEST} names {tag}: not yet {tag_folder}"
        prefix, tag_name = "", tag_folder
    else:
        prefix, tag_name = tag + "/", tag
        got = fp.files.get(tag)
        if got is None or got[2] != "dir":
            return f"{LATEST} names {tag}, which is not a folder here"
    ranks: set[int] = set()
    models = 0
    sizes: dict[str, list[int]] = {}
    for rel, (size, mtime, kind) in fp.files.items():
        if not rel.startswith(prefix) or "/" in rel[len(prefix):] or kind != "file":
            continue
        name = rel[len(prefix):]
        m = _OPTIM.match(name)
        if m is None and not _MODEL_STATES.match(name):
            continue
        if m is not None:
            ranks.add(int(m.group(1)))
        else:
            models += 1
        reason = _whole_zip(root / rel if not outside else root / tag_folder / rel, size)
        if reason is not None:
            return f"{rel} {reason}"
        sizes[rel] = [size, mtime]
    if not models:
        return f"no *_model_states.pt in {tag_name}"
    if not ranks:
        return f"no *_optim_states.pt in {tag_name}"
    world = _world(root / tag_name, fp, prefix)
    if world is None:
        return f"the optimizer states of rank 0 in {tag_name} are not readable yet"
    if ranks != set(range(world)):
        gap = sorted(set(range(world)) - ranks) or sorted(ranks - set(range(world)))
        return f"optimizer states of rank {gap[0]} missing in {tag_name} (saved by {world} ranks)"
    identity["tag"] = tag_name
    identity["rank_files"] = dict(sorted(sizes.items()))
    return None


def _world(folder: Path, fp: Fingerprint, prefix: str) -> int | None:
    """The data-parallel world size rank 0's optimizer states record (DeepSpeed's
    ``partition_count``), read by the ZeRO source's own allow-list reader; None when unreadable."""
    from ckptctl.errors import InputError
    from ckptctl.sources.zero.files import read_optim_states

    for rel in sorted(fp.files):
        m = _OPTIM.match(rel[len(prefix):]) if rel.startswith(prefix) else None
        if m is not None and m.group(1) == "0" and "/" not in rel[len(prefix):]:
            try:
                return read_optim_states(folder / rel[len(prefix):], "rank 0's optimizer states").world
            except (InputError, OSError):
                return None
    return None


def _whole_zip(path: Path, size: int) -> str | None:
    """None when the file ends with a zip's end-of-central-directory record (no comment: torch
    writes none), else why not."""
    import os

    if size < 22:
        return "is shorter than a zip"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    try:
        tail = os.pread(fd, 22, size - 22)
    except OSError as exc:  # swapped for a FIFO or a directory since it was listed
        return f"unreadable ({exc.strerror})"
    finally:
        os.close(fd)
    return None if tail[:4] == _EOCD else "does not end a zip yet (being written)"
