"""What the destination's old version loses and keeps when a new version replaces it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from ckptctl import layout as L
from ckptctl import staging
from ckptctl.format.names import MANIFEST_NAME

MAIN = ("model", None)  # the slot of a transformers model without a variant


def superseded(dest: Path, *, slot: tuple[str, str | None] = MAIN,
               lay: L.Layout | None = None) -> tuple[list[str], list[str]]:
    """(files the new version drops, files carried over) among ``dest``'s top-level entries.

    A file is dropped only when it is provably superseded; everything else of the user's is
    carried. The new version fills one slot (:func:`ckptctl.layout.slot_of`: the library stem
    and the variant it writes). It drops exactly the weights families of that slot (safetensors
    and pickle, single or sharded, with their indexes, and a shard of the slot that no index
    names) and the leftovers ``layout`` recognises (only the exact patterns of
    :data:`ckptctl.format.names.LEFTOVERS`, the gc-tmp presets' own rules; one that a process
    holds open, such as a download still running, is carried). Writing the main model slot also
    drops DCP files. Any other file is carried, whatever its name: ``optimizer.safetensors``,
    LLaVA's ``mm_projector.safetensors``, a ``consolidated.safetensors``, a ``.tmpl/`` or a
    user's ``_tmp_scratch/`` directory. Other variants, other components (diffusers, PEFT
    adapters) are kept. The old manifest is always dropped: it describes the old version.
    ``lay``: the scan of ``dest`` as it is now, when the caller has it.
    """
    if not os.path.isdir(dest):
        return [], []
    if lay is None:
        lay = L.scan(dest)
    # (no leftover: nothing to ask of /proc, and the staging machinery stays unimported)
    live = staging.open_elsewhere([dest / n for n in lay.leftovers]) if lay.leftovers else set()
    drop: set[str] = {n for n in lay.leftovers if dest / n not in live}
    main = slot == MAIN
    for fam in lay.families:
        if fam.slot == slot or (main and fam.kind == L.DCP):
            drop.update(fam.all_files)
    names = sorted(os.listdir(dest))
    drop.update(n for n in names if L.named_slot(n) == slot)  # a file of the slot no index names
    drop.add(MANIFEST_NAME)
    keep = [n for n in names if n not in drop]
    return sorted(drop & set(names)), keep


def replacement(dest: Path, *, slot: tuple[str, str | None], written: Iterable[str],
                variants: Iterable[str], reading: Any = None) -> tuple[list[str], list[str]]:
    """(files removed, files carried) when a new version that writes ``written`` (its shards,
    index and extras) and copies the source's ``variants`` replaces ``dest``'s old version in
    ``slot``: :func:`superseded`'s answer, where a variant family of the source replaces the old
    version's family of the same slot whole (never a variant index kept beside shards it no longer
    names), and a file the new version writes again is neither carried nor counted as removed.
    ``reading``: the command's metadata reading, through which ``dest`` is scanned."""
    lay = L.scan(dest, reading=reading) if reading is not None and os.path.isdir(dest) else None
    removed, carried = superseded(dest, slot=slot, lay=lay)
    written, variants = set(written), set(variants)
    variant_slots = {L.named_slot(v) for v in variants}
    replaced = written | variants | {n for n in carried if L.named_slot(n) in variant_slots}
    return (sorted((set(removed) | (set(carried) & replaced)) - written - variants),
            [n for n in carried if n not in replaced])
