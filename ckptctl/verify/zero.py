"""A DeepSpeed ZeRO checkpoint (a root with ``latest``, or a step folder): every rank's files
present, complete, of the same run, and their partitions what ``param_shapes`` needs, read by
the ZeRO source's own reader (:mod:`ckptctl.sources.zero.source`; no torch, no deepspeed)."""

from __future__ import annotations

import math

from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR, INFO
from ckptctl.sources.zero.locate import ZeroLocation
from ckptctl.verify.context import Context


def check_zero(ctx: Context, loc: ZeroLocation) -> None:
    """The ZeRO kind's verify hook (``sources/kinds.py``): ``zero.checkpoint`` (info: stage, world
    size, parameters) or ``zero.damaged`` (error: a rank file missing, truncated, of another run,
    naming a global outside the allow-list)."""
    from ckptctl.sources.zero.source import ZeroCheckpoint

    try:
        ck = ZeroCheckpoint(loc)
        params = [*ck.frozen(), *ck.parameters()]
    except CkptctlError as exc:  # a rank file missing, truncated, unreadable, of another run
        ctx.add("zero.damaged", ERROR, ctx.disp(), exc.message, exc.hint)
        return
    elements = sum(math.prod(shape) for _, shape, _, _ in params)
    ctx.add("zero.checkpoint", INFO, str(loc.folder),
            f"DeepSpeed ZeRO stage {ck.stage} checkpoint ({loc.tag}) of {ck.world} ranks: {len(params)} parameters, "
            f"{elements:,} elements of fp32 master weights", f"export them with `ckptctl export {ctx.root} DST`",
            stage=ck.stage, world_size=ck.world, tag=loc.tag, parameters=len(params), elements=elements)
