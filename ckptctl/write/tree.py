"""A multi-component root (a diffusers pipeline, a sentence-transformers model) written as ONE
directory, published once.

A root is several models beside the files that tie them together (``model_index.json`` +
``unet/`` ``vae/`` ``text_encoder/`` ``scheduler/`` ``tokenizer/``; ``modules.json`` +
``sentence_bert_config.json`` + module 0 at the root + ``2_Dense/``). :func:`export_root` and
:func:`ckptctl.resave.root.resave_root` build the whole new root in one staging directory of the destination:

1. the root's other entries (manifests, configs, ``scheduler/``, ``tokenizer/``, weightless
   modules) are copied from the source (hard-linked when resaving in place);
2. the old destination's entries the source does not have are kept (hard links), as a single
   export keeps the destination's non-weight files; its weights folders are carried into the
   new version first, so the component's own export decides (``write/superseded.py``) what of
   them it drops and keeps (another variant, a config it does not write);
3. each component with weights is written by the normal single-component writer (``export``:
   :func:`~ckptctl.write.job.write_inputs`; resave, given the same :func:`write_root` with its
   own component writer: :func:`ckptctl.resave.resave` with ``output``) into ``<staging>/data/<folder>``, under its own library's names (a diffusers
   component stays ``diffusion_pytorch_model*``, a transformers one ``model*``); module 0 of a
   sentence-transformers root is written beside, then moved up into ``data/``;
4. ``data/`` is sealed and published over the destination once, by the same
   :class:`~ckptctl.publish.Stage` as a single export: a crash at any point leaves the old root
   or the new one, and whatever it leaves behind is one staging directory ``gc-tmp`` removes.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ckptctl import _faults
from ckptctl import layout as L
from ckptctl.errors import InputError, UsageError, from_oserror
from ckptctl.manifest import MANIFEST_NAME, build_manifest, encode_manifest, list_files
from ckptctl.publish import Stage, check_destination
from ckptctl.staging import recover_destination
from ckptctl.write.inputs import check_paths, open_inputs
from ckptctl.write.job import copy_verbatim, create_stage, failed, write_inputs
from ckptctl.write.options import ExportOptions, validate
from ckptctl.write.files import link_or_copy
from ckptctl.write.superseded import superseded

if TYPE_CHECKING:
    from ckptctl.layout.reading import MetadataReading

ROOTS = L.ROOTS
ROOT_MODULE = ".ckptctl-root-module"  # inside data/: where module 0 is written before it moves up

# (source folder, destination folder, options) -> the component's result
ComponentWriter = Callable[[Path, Path, ExportOptions], Any]


@dataclass
class RootResult:
    """What writing a multi-component root did (or, with ``dry_run``, would do)."""

    dest: str
    dry_run: bool
    kind: str  # diffusers-pipeline | sentence-transformers
    # folder ("" for module 0 at the root) -> that component's ExportResult / ResaveResult
    components: dict[str, Any] = field(default_factory=dict)
    copied: list[str] = field(default_factory=list)  # the source root's other entries, copied as they are
    kept: list[str] = field(default_factory=list)  # the old destination's entries the source does not have
    removed: list[str] = field(default_factory=list)  # the old destination's top-level entries dropped
    publish: str | None = None
    manifest: str | None = None
    recovered: list[str] = field(default_factory=list)
    unchanged: bool = False  # resave --repair of a sound root: nothing written
    seconds: float = 0.0

    @property
    def notes(self) -> list[str]:
        """What the components' sources say the user should know."""
        return [n for r in self.exports.values() for n in getattr(r, "notes", ())]

    @property
    def exports(self) -> dict[str, Any]:
        """Each component's ExportResult (a resave's is inside its ResaveResult)."""
        return {k: getattr(v, "export", v) for k, v in self.components.items()}

    @property
    def tensors(self) -> int:
        return sum(r.tensors for r in self.exports.values())

    @property
    def parameters(self) -> int:
        return sum(r.parameters for r in self.exports.values())

    def to_dict(self) -> dict[str, Any]:
        doc = {k: v for k, v in self.__dict__.items() if k != "components"}
        doc["tensors"], doc["parameters"] = self.tensors, self.parameters
        doc["components"] = {k or ".": v.to_dict() for k, v in sorted(self.components.items())}
        return doc


def is_root(path: str | os.PathLike[str], lay: L.Layout | None = None) -> bool:
    """Whether ``path`` is a multi-component root, written (exported, resaved) as a whole.
    ``lay``: its scan, when the caller has it."""
    p = Path(path)
    return p.is_dir() and (lay if lay is not None else L.scan(p)).kind in ROOTS


def weighted_folders(lay: L.Layout) -> list[str]:
    """The folders of ``lay``'s components that hold weights ("" for module 0 at the root),
    root first. A component in a nested folder is refused (no library writes one)."""
    out: set[str] = set()
    for c in lay.components:
        if c.path == "" and lay.families:
            out.add("")
        elif c.path and c.has_weights:
            if "/" in c.path:
                raise UsageError(f"{lay.root}: component {c.name!r} lives in the nested folder {c.path!r}",
                                 "write that component's folder on its own")
            out.add(c.path)
    return sorted(out)


# -- export ---------------------------------------------------------------------------------------


def export_root(src: str | os.PathLike[str], dst: str | os.PathLike[str], opts: ExportOptions, *,
                key: str | None = None, only: str | None = None,
                reading: "MetadataReading | None" = None) -> RootResult:
    """Export the multi-component root at ``src`` to ``dst`` as one directory: every component
    with weights exported under its own library's names, the rest of the root copied, published
    once. ``key``/``only`` apply to each component; ``reading``: the command's metadata reading."""
    validate(opts, only=only, key=key)
    src_p = Path(src)
    check_paths(src_p, Path(dst))
    lay = L.scan(src_p, reading=reading)
    if lay.kind not in ROOTS:
        raise InputError(f"{src_p} is not a multi-component root", "export it with `ckptctl export`")

    def write(folder: Path, out: Path, o: ExportOptions) -> Any:
        with open_inputs(folder, out, o, key=key, only=only, root_module=True) as inputs:
            return write_inputs(inputs, out)

    return write_root(src_p, lay, dst, opts, write, link=False)


# -- the one root writer --------------------------------------------------------------------------


def write_root(src: Path, lay: L.Layout, dst: str | os.PathLike[str], opts: ExportOptions,
               write: ComponentWriter, *, link: bool, from_source: bool = False,
               sound: dict[str, Any] | None = None) -> RootResult:
    """Build the root ``src`` (scanned as ``lay``) at ``dst`` with ``write`` for each component
    with weights, in one staging directory, and publish it once (see the module docstring).
    ``link``: the source's files are hard-linked (resave in place) instead of copied.
    ``from_source``: a component folder the destination does not have starts as a copy of the
    source's (resave keeps what the component's writer does not write: another variant).
    ``sound``: component folders (and their results) carried as they are, not written."""
    sound = sound or {}
    started = time.monotonic()
    dest = Path(os.path.abspath(dst))
    folders = weighted_folders(lay)
    result = RootResult(str(dest), opts.dry_run, lay.kind, manifest=MANIFEST_NAME if opts.manifest else None)
    sub = replace(opts, overwrite=True, manifest=False)
    if opts.dry_run:
        check_destination(dest, overwrite=opts.overwrite)
        for f in folders:
            result.components[f] = write(src / f if f else src, dest / f if f else dest, sub)
        result.copied = _root_entries(src, folders)
        result.seconds = time.monotonic() - started
        return result
    result.recovered = recover_destination(dest)
    existed = check_destination(dest, overwrite=opts.overwrite)
    stage = Stage(dest, fsync=opts.fsync, command=opts.command)
    phase = "stage"
    try:
        result.copied = _root_entries(src, folders)
        data = create_stage(stage, sum(_bytes(src / n) for n in result.copied), files=len(result.copied) + 4)
        phase = "write"
        for name in result.copied:
            _carry(src / name, data / name, link=link, fsync=opts.fsync)
        if existed and dest != src:
            result.kept, result.removed = _keep_old(dest, data, folders, fsync=opts.fsync)
        for f in folders:
            if f:
                origin = dest / f if existed and (dest / f).is_dir() else (src / f if from_source else None)
                if origin is not None:  # the component's writer decides what of it to keep
                    _carry(origin, data / f, link=link or origin.parent == dest, fsync=opts.fsync)
                result.components[f] = sound[f] if f in sound else write(src / f, data / f, sub)
            else:
                result.components[f] = write(src, data / ROOT_MODULE, sub)
                _move_up(data / ROOT_MODULE, data)
        _faults.point("root-written")
        phase = "finalize"
        if opts.manifest:
            stage.write_file(MANIFEST_NAME, encode_manifest(build_manifest(data, list_files(data), label=opts.label)))
        stage.seal()
        stage.check_competitors()
        phase = "publish"
        result.publish = stage.publish(replace=existed)
        _faults.point("root-published")
        stage.finish()
    except OSError as exc:
        failed(stage, dest, exc, phase)
        raise from_oserror(exc, f"cannot write the {lay.kind} root", phase=phase) from None
    except BaseException as exc:
        failed(stage, dest, exc, phase)
        raise
    result.seconds = time.monotonic() - started
    return result


def _root_entries(src: Path, folders: list[str]) -> list[str]:
    """The source root's entries carried as they are: everything but the component folders with
    weights, module 0's weights (its writer writes them), leftovers and an old manifest."""
    dropped = set(superseded(src)[0])  # what a new version of the root's main model drops
    return [n for n in sorted(os.listdir(src)) if n not in folders and n not in dropped]


def _bytes(path: Path) -> int:
    """The bytes below ``path`` that an independent copy writes (each component's own writer
    checks the room its weights need)."""
    if path.is_dir() and not path.is_symlink():
        return sum(_bytes(path / n) for n in os.listdir(path))
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _keep_old(dest: Path, data: Path, folders: list[str], *, fsync: bool) -> tuple[list[str], list[str]]:
    """Keep the old destination's top-level entries the new root has none of (hard links), as a
    single export keeps the destination's non-weight files; (kept, removed)."""
    removed, keep = superseded(dest)
    kept = []
    for n in keep:
        if n in folders or os.path.lexists(data / n):
            continue
        _carry(dest / n, data / n, link=True, fsync=fsync)
        kept.append(n)
    return kept, removed


def _carry(src: Path, dst: Path, *, link: bool, fsync: bool) -> None:
    """``src`` (a file or a folder) at ``dst``: hard links (``link``: the same directory's new
    version), else an independent copy in which a link to a file (an HF cache snapshot's link to
    its blob) becomes the file itself. Only regular files, folders and links are carried."""
    if link:
        link_or_copy(src, dst, fsync=fsync)
        return
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst, 0o755)
        for child in sorted(os.listdir(src)):
            _carry(src / child, dst / child, link=False, fsync=fsync)
    elif stat.S_ISREG(st.st_mode) or (stat.S_ISLNK(st.st_mode) and os.path.isfile(src)):
        copy_verbatim(src, dst, fsync=fsync)
    else:
        raise InputError(f"{src} is neither a regular file nor a folder (a link to a folder, a FIFO, a device)",
                         "replace it with what it points to, or remove it from the root")


def _move_up(tmp: Path, data: Path) -> None:
    """Module 0's files, written into ``tmp``, into the root ``data`` (replacing the copies of
    its config and tokenizer files the root carried)."""
    for n in sorted(os.listdir(tmp)):
        os.replace(tmp / n, data / n)
    os.rmdir(tmp)
