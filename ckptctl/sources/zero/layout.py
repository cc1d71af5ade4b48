"""Where each parameter of a ZeRO checkpoint sits in its ranks' flat fp32 partitions: the same
reconstruction as DeepSpeed's ``zero_to_fp32`` (``_zero2_merge_trainable_params``,
``_zero3_merge_trainable_params`` and the frozen-parameter merges), as byte :class:`Piece` s of
the rank files instead of tensors in memory. Pure: records in, pieces out.

- Stages 1/2: each optimizer group's fp32 vector is the concatenation of the ranks' partitions
  (rank 0 first); the group's parameters follow one another in ``param_shapes`` order, each
  followed by its ``param_alignment_paddings`` entry when the checkpoint records them; the
  group ends padded to a multiple of ``2 * world``, which must be all that is left.
- Stage 3: each parameter is split into ``world`` equal parts of ``ceil(numel / world)``
  elements, part ``r`` at the same offset of every rank's flat vector (the concatenation of its
  groups), the last part padded: the parameter is part 0, part 1, ... with the padding dropped.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable, Sequence

from ckptctl.errors import InputError
from ckptctl.sources.base import Piece
from ckptctl.sources.zero.files import Flat

_DAMAGED = "the checkpoint's partitions do not match its param_shapes: save it again"


class Concat:
    """The concatenation of ``parts`` (one rank's flat groups, or a group's rank partitions)."""

    def __init__(self, parts: Sequence[Flat]) -> None:
        self.parts = list(parts)
        self.starts: list[int] = []
        total = 0
        for p in self.parts:
            self.starts.append(total)
            total += p.numel
        self.numel = total

    def pieces(self, begin: int, count: int, dst: int, where: str) -> list[Piece]:
        """Elements ``[begin, begin + count)`` as pieces placed ``dst`` elements into a tensor.
        Raises InputError when they run past the end (``where`` names the parameter)."""
        if begin < 0 or begin + count > self.numel:
            raise InputError(f"{where}: needs elements {begin}..{begin + count} of a flat vector of {self.numel}",
                             _DAMAGED)
        out: list[Piece] = []
        i = bisect.bisect_right(self.starts, begin) - 1
        while count > 0:
            part = self.parts[i]
            lo = begin - self.starts[i]
            n = min(count, part.numel - lo)
            if n > 0:
                size = part.itemsize
                out.append(Piece(part.file, part.offset + lo * size, dst * size, n * size))
                begin, count, dst = begin + n, count - n, dst + n
            i += 1
        return out


def _check_dtype(parts: Iterable[Flat], where: str) -> str:
    dtypes = {p.dtype for p in parts}
    if len(dtypes) != 1:
        raise InputError(f"{where}: the flat partitions mix dtypes ({', '.join(sorted(dtypes))})", _DAMAGED)
    return dtypes.pop()


def stage12_pieces(shapes: Sequence[dict[str, tuple[int, ...]]], groups: Sequence[Sequence[Flat]],
                   paddings: Sequence[Sequence[int]] | None, world: int, where: str
                   ) -> list[tuple[str, tuple[int, ...], str, list[Piece]]]:
    """(name, shape, dtype, pieces) of every trainable parameter of a stage 1/2 checkpoint;
    ``groups[r][g]`` is rank ``r``'s partition of group ``g``."""
    if any(len(g) != len(shapes) for g in groups):
        counts = sorted({len(g) for g in groups})
        raise InputError(f"{where}: the ranks hold {counts} optimizer groups, param_shapes lists {len(shapes)}",
                         _DAMAGED)
    if paddings is not None and len(paddings) != len(shapes):
        raise InputError(f"{where}: {len(paddings)} alignment padding lists for {len(shapes)} groups", _DAMAGED)
    align = 2 * world
    out = []
    for g, group_shapes in enumerate(shapes):
        flat = Concat([groups[r][g] for r in range(world)])
        dtype = _check_dtype(flat.parts, where)
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(group_shapes):
            raise InputError(f"{where}: group {g} has {len(pads)} alignment paddings for {len(group_shapes)} "
                             "parameters", _DAMAGED)
        offset = 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            n = math.prod(shape)
            out.append((name, shape, dtype, flat.pieces(offset, n, 0, f"{where}: parameter {name!r}")))
            offset += n + (pads[i] if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(flat.numel / align):
            raise InputError(f"{where}: group {g} has {flat.numel} elements, its parameters use {offset}", _DAMAGED)
    return out


def stage3_pieces(shapes: Sequence[dict[str, tuple[int, ...]]], groups: Sequence[Sequence[Flat]],
                  world: int, where: str) -> list[tuple[str, tuple[int, ...], str, list[Piece]]]:
    """(name, shape, dtype, pieces) of every trainable parameter of a stage 3 checkpoint;
    ``groups[r]`` are rank ``r``'s flat fp32 groups."""
    sizes = [[p.numel for p in g] for g in groups]
    if any(s != sizes[0] for s in sizes):
        raise InputError(f"{where}: the ranks' flat groups differ in size ({sizes[0]} on rank 0)", _DAMAGED)
    flats = [Concat(g) for g in groups]
    dtype = _check_dtype([p for g in groups for p in g], where)
    merged: dict[str, tuple[int, ...]] = {}
    for g in shapes:
        merged.update(g)
    out = []
    offset = 0
    for name, shape in merged.items():
        n = math.prod(shape)
        part = math.ceil(n / world)
        pieces: list[Piece] = []
        for r, flat in enumerate(flats):
            take = max(0, min(part, n - r * part))  # the last parts hold the padding
            if take:
                pieces.extend(flat.pieces(offset, take, r * part, f"{where}: parameter {name!r}"))
        out.append((name, shape, dtype, pieces))
        offset += part
    if offset != flats[0].numel:
        raise InputError(f"{where}: each rank holds {flats[0].numel} elements, the parameters use {offset}", _DAMAGED)
    return out


def frozen3_pieces(shape: tuple[int, ...], fragments: Sequence[Flat], name: str, where: str) -> list[Piece]:
    """A frozen stage 3 parameter: the ranks' fragments concatenated, cut to its size."""
    n = math.prod(shape)
    flat = Concat(fragments)
    return flat.pieces(0, n, 0, f"{where}: frozen parameter {name!r}")
