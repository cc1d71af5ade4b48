"""``resave`` of a multi-component root (a diffusers pipeline, a sentence-transformers model):
every component with weights resaved by the one-model resave (:func:`ckptctl.resave.resave`,
handed in as ``resave_one``) into one staging directory, published once by the root writer
(:func:`ckptctl.write.tree.write_root`)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ckptctl import layout as L
from ckptctl.errors import InputError
from ckptctl.manifest import MANIFEST_NAME
from ckptctl.write.options import ExportOptions, validate
from ckptctl.write.superseded import superseded
from ckptctl.write.tree import ROOTS, RootResult, weighted_folders, write_root


def resave_root(root: str | os.PathLike[str], opts: ExportOptions, *, resave_one: Callable[..., Any],
                output: str | os.PathLike[str] | None = None, repair: bool = False, prefer: str | None = None,
                link: bool = False, lay: L.Layout | None = None, static: bool = False) -> RootResult:
    """Resave every component with weights of the root at ``root`` (in place, or into
    ``output``) through ``resave_one`` (:func:`ckptctl.resave.resave`), into one staging
    directory, published once. ``--repair`` of a sound root (every component sound, no leftover
    at the root) writes nothing (``unchanged``). ``lay``: the root's scan, when the caller has it;
    ``static``: the repairs' verify runs the static rules only."""
    root_p = Path(root)
    opts = replace(opts, overwrite=True if not output else opts.overwrite)
    validate(opts)
    lay = lay if lay is not None else L.scan(root_p)
    if lay.kind not in ROOTS:
        raise InputError(f"{root_p} is not a multi-component root", "resave it with `ckptctl resave`")
    in_place = output is None or os.path.realpath(output) == os.path.realpath(root_p)

    def write(folder: Path, out: Path, o: ExportOptions) -> Any:
        target = None if os.path.realpath(out) == os.path.realpath(folder) else out  # a dry run in place
        # module 0 lives at the root itself: resaved as one model, not as the root again
        return resave_one(folder, o, output=target, repair=repair, prefer=prefer, link=in_place or link,
                          whole_root=folder != root_p, static=static)

    if repair and in_place:
        probe = replace(opts, dry_run=True)
        checked = {f: write(root_p / f if f else root_p, root_p / f if f else root_p, probe)
                   for f in weighted_folders(lay)}
        # at the root itself: leftovers, stray weights (module 0's own files are its resave's)
        stale = set(superseded(root_p)[0]) - {MANIFEST_NAME} - (lay.weight_files if "" in checked else set())
        if all(r.unchanged for r in checked.values()) and not stale:
            return RootResult(str(Path(os.path.abspath(root_p))), opts.dry_run, lay.kind, checked, unchanged=True)
        # a sound component folder is carried as it is (hard links), never rewritten
        sound = {f: r for f, r in checked.items() if r.unchanged and f}
        return write_root(root_p, lay, root_p, opts, write, link=True, from_source=True, sound=sound)
    return write_root(root_p, lay, root_p if in_place else Path(output), opts, write,  # type: ignore[arg-type]
                      link=in_place or link, from_source=True)
