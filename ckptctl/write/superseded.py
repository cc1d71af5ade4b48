"""What the destination's old version loses and keeps when a new version replaces it."""

from __future__ import annotations

import os
from pathlib import Path

from ckptctl import layout as L
from ckptctl.format import names as N
from ckptctl.manifest import MANIFEST_NAME

MAIN = ("model", None)  # the slot of a transformers model without a variant


def superseded(dest: Path, *, slot: tuple[str, str | None] = MAIN) -> tuple[list[str], list[str]]:
    """(files the new version drops, files carried over) among ``dest``'s top-level entries.

    The new version fills one slot (:func:`ckptctl.layout.slot_of`: the library stem and the
    variant it writes). It drops exactly the weights families of that slot (safetensors and
    pickle, single or sharded, with their indexes) and leftovers. Writing the main model slot
    also drops what a loader of the main model could pick instead: DCP files, any other
    top-level ``*.safetensors`` outside the naming scheme (a glob-loader would pick it up) and
    unnamed indexes. Other variants, other components (diffusers, PEFT adapters) and every other
    file are kept. The old manifest is always dropped: it describes the old version.
    """
    if not os.path.isdir(dest):
        return [], []
    lay = L.scan(dest)
    drop: set[str] = set(lay.leftovers)
    main = slot == MAIN
    for fam in lay.families:
        if fam.slot == slot or (main and fam.kind == L.DCP):
            drop.update(fam.all_files)
    names = sorted(os.listdir(dest))
    for n in names:
        named = L.named_slot(n)
        if named == slot:  # a file of the slot no index names (an unreferenced shard)
            drop.add(n)
        elif main and named is None and (n.endswith(".safetensors") or n.endswith(N.INDEX_SUFFIXES)):
            drop.add(n)
    drop.add(MANIFEST_NAME)
    keep = [n for n in names if n not in drop]
    return sorted(drop & set(names)), keep
