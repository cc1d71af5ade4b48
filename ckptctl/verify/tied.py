"""``--deep``: a config that ties the output head to the embedding while a different
``lm_head.weight`` is stored.

transformers ties the head to the embedding after loading and ignores the stored head without a
word: if its bytes differ from the embedding's, the model that was trained is not the one users
get. Only the bytes tell, so this runs under ``--deep`` and reads the two tensors (safetensors).
"""

from __future__ import annotations

import os

from ckptctl.config_fields import ConfigFields
from ckptctl.findings import ERROR, INFO
from ckptctl.format.header import TensorInfo
from ckptctl.verify.architectures import SPECS
from ckptctl.verify.context import Context, FamilyTensors

EMBEDDINGS = tuple(s.embed for s in SPECS) + ("shared.weight",)
HEADS = tuple(s.lm_head for s in SPECS)


def _locate(ctx: Context, name: str) -> tuple[str, TensorInfo, int] | None:
    """(file, tensor record, data start) of a safetensors tensor that was read."""
    for fname, read in ctx.reads.items():
        hdr = read.header
        if hdr is not None and hdr.ok and name in hdr.tensors:
            return fname, hdr.tensors[name], hdr.data_start
    return None


def _read(ctx: Context, where: tuple[str, TensorInfo, int]) -> bytes:
    fname, info, start = where
    fd = os.open(ctx.root / fname, os.O_RDONLY)
    try:
        return os.pread(fd, info.end - info.begin, start + info.begin)
    finally:
        os.close(fd)


def tied_bytes_step(ctx: Context, cfg: dict, loaded: FamilyTensors) -> None:
    if ConfigFields(cfg).get("tie_word_embeddings") is not True:
        return
    names = list(loaded.tensors)
    heads = [n for n in names if n.endswith(HEADS) and ".layers." not in n and ".h." not in n]
    embeds = [n for n in names if n.endswith(EMBEDDINGS)]
    if len(heads) != 1 or not embeds:
        return
    head = heads[0]
    embed = min(embeds, key=len)
    where_h, where_e = _locate(ctx, head), _locate(ctx, embed)
    shown = ctx.disp("config.json")
    if where_h is None or where_e is None:
        ctx.add("config.not_checked", INFO, shown, f"{head!r} is not in a safetensors file; its bytes are not "
                "compared with the tied embedding")
        return
    a, b = loaded.tensors[head], loaded.tensors[embed]
    try:
        same = (a.dtype, a.shape) == (b.dtype, b.shape) and _read(ctx, where_h) == _read(ctx, where_e)
    except OSError as exc:
        ctx.io(where_h[0], exc)
        return
    if not same:
        ctx.add("config.lm_head_tied_differs", ERROR, shown,
                f"tie_word_embeddings is true but the stored {head!r} differs from {embed!r}: transformers "
                "ties the head to the embedding and silently drops the stored head",
                "set tie_word_embeddings to false if the head was trained separately (or re-export)",
                tensor=head, embedding=embed)
