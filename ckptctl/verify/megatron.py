"""A Megatron-core ``torch_dist`` checkpoint (the ``--save`` root or an iteration folder), read by
the export source's own reader (:mod:`ckptctl.sources.megatron.source`; no torch, no megatron):
every chunk present and inside its ``.distcp`` file, the chunks tiling each tensor, and whether a
mapping to HF names covers the model the arguments describe."""

from __future__ import annotations

import math

from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR, INFO
from ckptctl.sources.megatron.locate import MegatronLocation
from ckptctl.verify.context import Context


def check_megatron(ctx: Context, loc: MegatronLocation) -> None:
    """The Megatron kind's verify hook (``sources/kinds.py``): ``megatron.checkpoint`` (info: the
    iteration, the tensors, the mapping that applies), ``megatron.not_mapped`` (note: no mapping
    covers the arguments, so only ``--names megatron`` exports it) or ``megatron.damaged``
    (error: a chunk missing or outside its file, shards that do not tile, an unreadable
    ``common.pt`` or ``.metadata``)."""
    from ckptctl.sources.megatron.source import MegatronSource

    try:
        with MegatronSource.open_location(loc, fallback=True) as src:
            tensors = len(src.tensors)
            elements = sum(math.prod(t.shape) for t in src.tensors)
            family, why = src.family, src.mapping_error
    except CkptctlError as exc:
        ctx.add("megatron.damaged", ERROR, ctx.disp(), exc.message, exc.hint)
        return
    where = str(loc.folder)
    if why:
        ctx.add("megatron.not_mapped", INFO, where, f"Megatron checkpoint (iteration {loc.iteration}): {why}",
                f"export Megatron's own names with `ckptctl export {ctx.root} DST --names megatron`",
                iteration=loc.iteration)
    ctx.add("megatron.checkpoint", INFO, where,
            f"Megatron-core torch_dist checkpoint (iteration {loc.iteration}): {tensors} tensors, {elements:,} "
            f"elements, every chunk present and tiling its tensor; mapping: {family or 'none'}",
            f"export it with `ckptctl export {ctx.root} DST`",
            iteration=loc.iteration, tensors=tensors, elements=elements, mapping=family)
