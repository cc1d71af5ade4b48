"""A Megatron-core ``torch_dist`` checkpoint (the ``--save`` root or an iteration folder), read by
the export source's own reader (:mod:`ckptctl.sources.megatron.source`; no torch, no megatron):
every chunk present and inside its ``.distcp`` file, the chunks tiling each tensor, the arguments
agreeing with the tensors, and whether a mapping to HF names covers the model."""

from __future__ import annotations

import math

from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR, INFO
from ckptctl.sources.megatron.locate import MegatronLocation
from ckptctl.verify.context import Context


def check_megatron(ctx: Context, loc: MegatronLocation) -> None:
    """The Megatron kind's verify hook (``sources/kinds.py``): ``megatron.checkpoint`` (info: the
    iteration, the tensors, the keys' layout, the MTP layers and the mapping that applies, and
    what was checked), ``megatron.not_mapped`` (note: no mapping covers the arguments, or there
    are none, so only ``--names megatron`` or ``--config`` exports it), ``megatron.args_disagree``
    (error: a tensor contradicts the recorded arguments: a size, the layer or expert count),
    ``megatron.vocab_padded`` (note: the tokenizer's size is not in the arguments, every padded
    row is exported) or ``megatron.damaged`` (error: a chunk missing or outside its file, shards
    that do not tile, an unreadable ``common.pt`` or ``.metadata``)."""
    from ckptctl.sources.megatron.source import MegatronSource

    try:
        with MegatronSource.open_location(loc, fallback=True) as src:
            tensors = len(src.tensors)
            elements = sum(math.prod(t.shape) for t in src.tensors)
            family, why, disagrees = src.family, src.mapping_error, src.disagrees
            keys, mtp, notes = src.keys, src.mtp_layers, list(src.notes)
    except CkptctlError as exc:
        ctx.add("megatron.damaged", ERROR, ctx.disp(), exc.message, exc.hint)
        return
    where = str(loc.folder)
    if why and disagrees:
        ctx.add("megatron.args_disagree", ERROR, where, f"Megatron checkpoint (iteration {loc.iteration}): {why}",
                "the arguments in common.pt are not the model's (a resumed run with other flags?); export with "
                f"`ckptctl export {ctx.root} DST --config CONFIG_JSON` and the model's config.json",
                iteration=loc.iteration)
    elif why:
        ctx.add("megatron.not_mapped", INFO, where, f"Megatron checkpoint (iteration {loc.iteration}): {why}",
                f"export Megatron's own names with `ckptctl export {ctx.root} DST --names megatron`, or map them "
                "with --config CONFIG_JSON", iteration=loc.iteration)
    for note in notes:
        ctx.add("megatron.vocab_padded", INFO, where, note, "pass --vocab-size N to export to keep the first N rows",
                iteration=loc.iteration)
    checked = "every chunk present, within its file and tiling its tensor"
    if family:
        checked += ", the arguments agreeing with every tensor"
    ctx.add("megatron.checkpoint", INFO, where,
            f"Megatron-core torch_dist checkpoint (iteration {loc.iteration}): {tensors} tensors, {elements:,} "
            f"elements, {keys} layer keys, {mtp} MTP layers; {checked}; mapping: {family or 'none'}",
            f"export it with `ckptctl export {ctx.root} DST`",
            iteration=loc.iteration, tensors=tensors, elements=elements, mapping=family, keys=keys, mtp_layers=mtp)
