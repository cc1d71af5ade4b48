"""The one ranking policy: which family a command reads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ckptctl.errors import InputError, UnrepairableError, UsageError
from ckptctl.layout.model import PEFT, Family, Layout
from ckptctl.sources.kinds import FAMILIES, SHAPES


@dataclass(frozen=True)
class Assessment:
    """What a caller that read the headers knows of a candidate family."""

    complete: bool  # every file present with a sound header
    agrees: bool  # consistent with config.json
    tensors: int = 0  # how many tensors its headers hold
    mtime: float = 0.0  # when its newest file was written
    missing: tuple[str, ...] = ()  # files it names that are not there

    def describe(self, fam: Family) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.mtime)) if self.mtime else "?"
        state = "complete" if self.complete else "incomplete" + (f" (missing {', '.join(self.missing[:3])})"
                                                                 if self.missing else "")
        return (f"{label(fam)}: {fam.describe()}, {self.tensors} tensors, written {when}, {state}, "
                + ("agrees with config.json" if self.agrees else "disagrees with config.json"))

    def to_dict(self, fam: Family) -> dict[str, Any]:
        return {"prefer": label(fam), "files": fam.all_files, "tensors": self.tensors, "mtime": self.mtime,
                "complete": self.complete, "missing": list(self.missing), "agrees_with_config": self.agrees}


def label(fam: Family) -> str:
    """The name ``--prefer`` takes for a family: its index, else its (first) file."""
    return fam.index or (sorted(fam.files)[0] if fam.files else "?")


def candidates(lay: Layout, *, twins: bool = False) -> list[Family]:
    """The families a command may read: the main (non-variant) ones, or a lone variant. A pickle
    family that holds the same tensors as a safetensors family (``Family.twin_of``) is left out
    unless ``twins`` (a command asked for a kind by name)."""
    fams = [f for f in lay.families if twins or f.twin_of is None]
    main = [f for f in fams if f.variant is None]
    return main or fams


def choose(lay: Layout, *, prefer: str | None = None, assess: Callable[[Family], Assessment] | None = None,
           among: list[Family] | None = None) -> Family:
    """Pick the family a command reads. ``prefer`` names a kind (``safetensors``, ``pytorch``,
    ``peft``, ``dcp``); between a single file and a sharded family of the same kind, ``index``
    or ``single``; or, among the candidates, one family by any of its file names (its
    :func:`label`, as an ambiguity lists it). With ``assess`` (a caller that has read the headers),
    a complete family that agrees with config.json wins over one that does not; two sound families
    are never chosen between silently (:class:`AmbiguousFamilies`, listing each with the exact
    ``--prefer`` to pass); none sound is a loss (:class:`UnrepairableError`). ``among`` narrows the
    candidates (default :func:`candidates`). Raises :class:`InputError` / :class:`UsageError` with
    the next step."""
    fams = candidates(lay, twins=prefer in FAMILIES) if among is None else list(among)
    if prefer in FAMILIES:
        fams = [f for f in fams if f.kind == prefer]
        if not fams:
            raise InputError(f"{lay.root} holds no {prefer} weights",
                             f"run `ckptctl inspect {lay.root}` to see what it holds")
    elif prefer in SHAPES:
        picked = [f for f in fams if f.sharded == (prefer == "index")]
        fams = picked or fams
    elif prefer is not None:
        named = [f for f in fams if prefer in f.all_files]
        if not named:
            known = sorted({label(f) for f in fams})
            raise UsageError(f"unknown preference {prefer!r}",
                             "use " + ", ".join([*FAMILIES, *SHAPES]) + (" or a family: " + ", ".join(known)
                                                                     if known else ""))
        fams = named
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
            raise _Unsound(lay, judged)
        if len({f.kind for f in sound}) == 1:
            raise AmbiguousFamilies(lay, [(f, a) for f, a in judged if f in sound])
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


class AmbiguousFamilies(InputError):
    """Two or more complete families agree with config.json: which one is the checkpoint is the
    user's call (exit 2). The message lists each (files, tensor count, mtime, agreement with
    config.json); the hint gives the exact ``--prefer`` values; ``--json`` carries them."""

    def __init__(self, lay: Layout, judged: list[tuple[Family, Assessment]]) -> None:
        judged = sorted(judged, key=lambda fa: -fa[1].mtime)  # the newest first
        self.families = [a.to_dict(f) for f, a in judged]
        lines = "".join(f"\n  {a.describe(f)}" for f, a in judged)
        choices = [f"`ckptctl resave --repair {lay.root} --prefer {label(f)}`" for f, _ in judged]
        super().__init__(f"{lay.root} holds {len(judged)} complete weight families that agree with config.json; "
                         f"which one is the checkpoint is not certain (newest first):{lines}",
                         f"keep the newest with {choices[0]}, or another with " + " or ".join(choices[1:])
                         + "; nothing was changed")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "families": self.families}


class _Unsound(UnrepairableError):
    def __init__(self, lay: Layout, judged: list[tuple[Family, Assessment]]) -> None:
        self.families = [a.to_dict(f) for f, a in judged]
        lines = "".join(f"\n  {a.describe(f)}" for f, a in judged)
        super().__init__(f"{lay.root}: none of the weight families is complete and consistent with config.json:{lines}",
                         "restore one of them from a copy (or keep one anyway with --prefer NAME); nothing was changed")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "families": self.families}
