"""``--deep``: a config that ties the output head to the embedding while a different
``lm_head.weight`` is stored.

transformers ties the head to the embedding after loading and ignores the stored head without a
word: if its bytes differ from the embedding's, the model that was trained is not the one users
get. Only the bytes tell, so this runs under ``--deep`` and compares the two tensors (safetensors)
window by window, through deep verify's reader: memory stays at two windows of
``VerifyOptions.chunk_bytes`` whatever the vocabulary size.
"""

from __future__ import annotations

from contextlib import ExitStack

from ckptctl.config_fields import ConfigFields
from ckptctl.findings import ERROR, INFO
from ckptctl.format import names as N
from ckptctl.format.header import TensorInfo
from ckptctl.verify.architectures import SPECS
from ckptctl.verify.context import Context, FamilyTensors

EMBEDDINGS = tuple(s.embed for s in SPECS) + ("shared.weight",)
HEADS = tuple(s.lm_head for s in SPECS)

Where = tuple[str, TensorInfo, int]  # file, tensor record, data start


def _locate(ctx: Context, name: str) -> Where | None:
    """(file, tensor record, data start) of a safetensors tensor that was read."""
    for fname, read in ctx.reads.items():
        hdr = read.header
        if hdr is not None and hdr.ok and name in hdr.tensors:
            return fname, hdr.tensors[name], hdr.data_start
    return None


def same_bytes(ctx: Context, a: Where, b: Where) -> bool:
    """Whether two tensors hold the same bytes, read in windows of ``chunk_bytes`` (the first
    differing window ends the comparison). Raises OSError when a file cannot be read."""
    from ckptctl.verify.deep import MIN_CHUNK_BYTES, open_unbuffered, read_windows, window_bytes  # --deep only

    (fa, ia, sa), (fb, ib, sb) = a, b
    length = ia.end - ia.begin
    if ib.end - ib.begin != length:
        return False
    window = min(window_bytes(ctx.options.chunk_bytes), max(length, MIN_CHUNK_BYTES))
    with ExitStack() as stack:
        ra = read_windows(stack.enter_context(open_unbuffered(ctx.root / fa)), bytearray(window), sa + ia.begin,
                          length)
        rb = read_windows(stack.enter_context(open_unbuffered(ctx.root / fb)), bytearray(window), sb + ib.begin,
                          length)
        return all(wa == wb for wa, wb in zip(ra, rb))


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
    shown = ctx.disp(N.CONFIG)
    if where_h is None or where_e is None:
        ctx.add("config.not_checked", INFO, shown, f"{head!r} is not in a safetensors file; its bytes are not "
                "compared with the tied embedding")
        return
    a, b = loaded.tensors[head], loaded.tensors[embed]
    try:
        same = (a.dtype, a.shape) == (b.dtype, b.shape) and same_bytes(ctx, where_h, where_e)
    except OSError as exc:
        ctx.io(where_h[0], exc)
        return
    if not same:
        ctx.add("config.lm_head_tied_differs", ERROR, shown,
                f"tie_word_embeddings is true but the stored {head!r} differs from {embed!r}: transformers "
                "ties the head to the embedding and silently drops the stored head",
                "set tie_word_embeddings to false if the head was trained separately (or re-export)",
                tensor=head, embedding=embed)
