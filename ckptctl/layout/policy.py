"""The one ranking policy: which family a command reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ckptctl.errors import InputError, UnrepairableError, UsageError
from ckptctl.layout.model import DCP, PEFT, PYTORCH, SAFETENSORS, Family, Layout



@dataclass(frozen=True)
class Assessment:
    """What a caller that read the headers knows of a candidate family."""

    complete: bool  # every file present with a sound header
    agrees: bool  # consistent with config.json


def candidates(lay: Layout) -> list[Family]:
    """The families a command may read: the main (non-variant) ones, or a lone variant."""
    main = [f for f in lay.families if f.variant is None]
    return main or list(lay.families)


def choose(lay: Layout, *, prefer: str | None = None, assess: Callable[[Family], Assessment] | None = None,
           among: list[Family] | None = None) -> Family:
    """Pick the family a command reads. ``prefer`` names a kind (``safetensors``, ``pytorch``,
    ``peft``, ``dcp``) or, between a single file and a sharded family of the same kind, ``index``
    or ``single``. With ``assess`` (a caller that has read the headers), a complete family that
    agrees with config.json wins over one that does not; two sound families are never chosen
    between silently; none sound is a loss (:class:`UnrepairableError`). ``among`` narrows the
    candidates (default :func:`candidates`). Raises :class:`InputError` / :class:`UsageError` with
    the next step."""
    fams = candidates(lay) if among is None else list(among)
    if prefer in (SAFETENSORS, PYTORCH, PEFT, DCP):
        fams = [f for f in fams if f.kind == prefer]
        if not fams:
            raise InputError(f"{lay.root} holds no {prefer} weights",
                             f"run `ckptctl inspect {lay.root}` to see what it holds")
    elif prefer in ("index", "single"):
        picked = [f for f in fams if f.sharded == (prefer == "index")]
        fams = picked or fams
    elif prefer is not None:
        raise UsageError(f"unknown preference {prefer!r}", "use safetensors, pytorch, peft, dcp, index or single")
    if not fams:
        raise InputError(f"{lay.root} holds no checkpoint weights (no safetensors, .bin, adapter or DCP files)",
                         "pass a checkpoint directory or a weights file")
    if len(fams) == 1:
        return fams[0]
    if assess is not None:
        judged = [(f, assess(f)) for f in fams]
        sound = [f for f, a in judged if a.complete and a.agrees]
        if len(sound) == 1:
            return sound[0]
        if not sound:
            raise _Unsound(lay, fams)
        fams = sound
    kinds = {f.kind for f in fams}
    if PEFT in kinds and len(kinds) == 2 and len(fams) == 2:
        other = next(f for f in fams if f.kind != PEFT)
        raise InputError(f"{lay.root} holds both a PEFT adapter and {other.kind} model weights",
                         f"choose one with --only {PEFT} or --only {other.kind}")
    if len(kinds) == 1 and {f.sharded for f in fams} == {True, False}:
        raise InputError(f"{lay.root}: both a single file and a sharded family with an index hold "
                         f"{next(iter(kinds))} weights ({'; '.join(f.describe() for f in fams)})",
                         f"keep one with `ckptctl resave --repair --prefer index|single {lay.root}`")
    raise InputError(f"{lay.root} holds several weight families: {', '.join(sorted(kinds))}",
                     "choose one with --only, or repair the directory with `ckptctl resave --repair`")


class _Unsound(UnrepairableError):
    def __init__(self, lay: Layout, fams: list[Family]) -> None:
        super().__init__(f"{lay.root}: none of the weight families ({'; '.join(f.describe() for f in fams)}) is "
                         "complete and consistent with config.json", "restore one of them; nothing was changed")
