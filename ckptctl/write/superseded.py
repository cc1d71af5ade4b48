"""What the destination's old version loses and keeps when a new version replaces it."""

from __future__ import annotations

import os
from pathlib import Path

from ckptctl import layout as L
from ckptctl.format import names as N
from ckptctl.manifest import MANIFEST_NAME


def superseded(dest: Path, *, adapter: bool) -> tuple[list[str], list[str]]:
    """(files the new version drops, files carried over) among ``dest``'s top-level entries.

    Exporting a full model drops every model weights family (safetensors or pickle, single or
    sharded, variants, with their indexes), DCP files, any other top-level ``*.safetensors`` a
    glob-loader would pick up, any ``pytorch_model*.bin``, and leftovers; it keeps adapters.
    Exporting an adapter drops only the adapter's weights (and leftovers). The old manifest is
    always dropped: it describes the old version. Everything else (config, tokenizer, README,
    optimizer state, directories) is kept.
    """
    if not os.path.isdir(dest):
        return [], []
    lay = L.scan(dest)
    drop: set[str] = set(lay.leftovers)
    for fam in lay.families:
        if (fam.kind == L.PEFT) == adapter:
            drop.update(fam.files)
            if fam.index:
                drop.add(fam.index)
    names = sorted(os.listdir(dest))
    if not adapter:
        for n in names:
            if n.endswith(".safetensors") and not n.startswith(N.ADAPTER_STEM):
                drop.add(n)
            if n.startswith("pytorch_model") and n.endswith((".bin", ".bin.index.json")):
                drop.add(n)  # variants too (pytorch_model.fp16.bin): a loader may still pick them
            if n.endswith(N.INDEX_SUFFIXES) or n == N.DCP_METADATA:
                drop.add(n)
    drop.add(MANIFEST_NAME)
    keep = [n for n in names if n not in drop]
    return sorted(drop & set(names)), keep
