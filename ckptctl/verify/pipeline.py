"""The verify pipeline: which steps run, in which order, over a checkpoint path.

A directory: scan (screen, then ``layout.scan``), the layout's findings, the weights families
(headers or pickles, index cross-checks, DCP), the model class its library builds (unless
``--static``), config.json, adapter_config.json, the component
folders of a multi-component root (each like a directory), the manifest, and with ``deep`` every
byte. A single weights file: its family alone, and ``deep``. Each step is
a function of the :class:`~ckptctl.verify.context.Context` registered under a check group name
(:class:`Check`); it returns None when it ran, or why it did not (no config.json, ``--deep`` not
asked), and every path's result lists the groups that ran and those that did not
(:class:`~ckptctl.verify.report.Checks`). A step that makes the rest impossible (the directory
cannot be listed) sets ``ctx.stopped``.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

from ckptctl import layout as L
from ckptctl.errors import InputError, UsageError
from ckptctl.findings import ERROR, SEVERITY_RANK, Finding
from ckptctl.format import names as N
from ckptctl.gcpause import paused
from ckptctl.layout.reading import MetadataReading
from ckptctl.layout.version import one_version
from ckptctl.verify.consistency import consistency_step
from ckptctl.verify.context import DEEP_NOT_ASKED, STATIC_ASKED, Context, ProgressFn, VerifyOptions
from ckptctl.verify.dcp import check_dcp
from ckptctl.verify.index import family_tensors
from ckptctl.verify.manifest import manifest_step
from ckptctl.verify.model import config_step, name_facts
from ckptctl.verify.peft import adapter_step
from ckptctl.verify.report import IO_CODE, Checks, PathResult, Report
from ckptctl.verify.screen import scan_directory

Step = Callable[[Context], "str | None"]  # None: it ran; a text: why it did not


class Check(NamedTuple):
    """A pipeline step and the check group it reports under."""

    group: str
    run: Step


# Layout findings verify reports at another severity, because verify judges upload readiness: an
# upload pushes a leftover (and loaders that glob *.safetensors read a temp shard).
UPLOAD_SEVERITY = {"layout.leftover": ERROR}
MODEL_LIBRARIES = ("diffusers", "transformers")
# verify's own rule beside layout's leftover table (names.LEFTOVERS): a lock file is no proof of
# an interrupted write, but an upload would push it.
LOCK_FILES = "*.lock"
# the Hub's documented per-file limit: HfApi.upload_file "Upload a local file (up to 50 GB)", and
# huggingface_hub.constants.MAX_HTTP_DOWNLOAD_SIZE = 50 * 1000 * 1000 * 1000
HUB_MAX_FILE_BYTES = 50 * 1000 * 1000 * 1000


def layout_findings(ctx: Context) -> str | None:
    """Layout's findings, passed through (the one severity override: :data:`UPLOAD_SEVERITY`),
    lock files, and a directory without weights."""
    assert ctx.layout is not None
    for f in ctx.layout.findings:
        ctx.result.findings.append(replace(f, severity=UPLOAD_SEVERITY[f.code]) if f.code in UPLOAD_SEVERITY else f)
    for n in ctx.names:
        if n not in ctx.hidden and fnmatch.fnmatchcase(n, LOCK_FILES):
            ctx.add("dir.lock_file", ERROR, ctx.disp(n), f"{n} is a lock file; an upload would push it",
                    "remove it once no process holds it")
    for n in ctx.names:
        if n in ctx.hidden:
            continue
        try:
            size = ctx.stat(n).st_size
        except OSError:
            continue  # screening reports an entry it cannot stat
        if size > HUB_MAX_FILE_BYTES:
            ctx.add("dir.file_too_large_for_hub", ERROR, ctx.disp(n),
                    f"{n} is {size:,} bytes, over the Hub's per-file limit of {HUB_MAX_FILE_BYTES:,} bytes (50 GB): "
                    "the upload is refused", "re-shard the checkpoint (ckptctl resave --max-shard-size 5GB)",
                    size=size, limit=HUB_MAX_FILE_BYTES)
    return None


def _kind(families: list[L.Family]) -> str:
    kinds = sorted({f.kind for f in families})
    if not kinds:
        return "none"
    if len(kinds) > 1:
        return "mixed"
    if kinds[0] == L.SAFETENSORS:
        return "safetensors-sharded" if any(f.index for f in families) else "safetensors"
    return kinds[0]


def weights_step(ctx: Context) -> str | None:
    """Every family layout found: its tensors (and index), or its DCP files."""
    assert ctx.layout is not None
    located = _located(ctx) if ctx.layout.single_file is None and not ctx.prefix else False
    for fam in ctx.layout.families:
        if fam.container == L.DCP:
            check_dcp(ctx, fam)
        else:
            ctx.tables.append(family_tensors(ctx, fam))
    if not ctx.prefix:
        ctx.result.kind = ctx.layout.kind if ctx.layout.components else _kind(ctx.layout.families)
    ctx.result.tensors += sum(len(t.tensors) for t in ctx.tables)
    if ctx.needs_weights and not located and not ctx.layout.families \
            and not any(c.has_weights for c in ctx.layout.components):
        ctx.add("dir.no_weights", ERROR, ctx.disp(),
                f"{ctx.disp()} holds no checkpoint weights (no safetensors, .bin, adapter, DCP, ZeRO or Megatron files)",
                "pass a checkpoint directory; if its weights belong here, export or copy them again")
    return None if ctx.layout.families or located else "no weights files"


def _located(ctx: Context) -> bool:
    """The located source kind at the root (``sources/kinds.locate``: a Megatron, ZeRO or DCP-HF
    checkpoint), checked by its own verify hook; a probe that finds its kind damaged (a tracker
    naming a missing step) is that kind's ``damaged`` finding. True when a kind was there."""
    from ckptctl.sources import kinds

    try:
        found = kinds.locate(ctx.root)
    except kinds.KindError as exc:
        ctx.add(exc.kind.codes[-1], ERROR, ctx.disp(), exc.message, exc.hint)
        return True
    if found is None:
        return False
    found.kind.hook("verify")(ctx, found.location)
    return True


def components_step(ctx: Context) -> str | None:
    """A multi-component root (diffusers pipeline, sentence-transformers model): every component
    folder layout found is verified like a checkpoint directory, into the same result. The
    transformers config rules run only on a component that transformers loads."""
    assert ctx.layout is not None
    if not ctx.layout.components:
        return "not a multi-component root: no model_index.json or modules.json"
    for comp in ctx.layout.components:
        if comp.path == "" or comp.layout is None:
            continue  # the root module is the root's own families; a missing folder is a layout finding
        sub = ctx.component(comp.path)
        sub.declared_class = (comp.library, comp.cls)
        # A model component (diffusers or transformers, saved with its config.json) must hold
        # weights; a scheduler, tokenizer or pooling module need not.
        sub.needs_weights = comp.library in MODEL_LIBRARIES and N.CONFIG in comp.layout.extras
        if comp.library == "transformers":
            _run(sub, COMPONENT_STEPS)
        else:
            sub.mark(CONFIG, f"{comp.library} component: the transformers config rules do not apply")
            _run(sub, tuple(c for c in COMPONENT_STEPS if c.group != CONFIG))
    return None


def model_class_step(ctx: Context) -> str | None:
    """The model-class check (:mod:`ckptctl.verify.classes`), imported only where it runs: not
    with ``--static``."""
    if ctx.options.static:
        return STATIC_ASKED
    from ckptctl.verify.classes import model_class_step as run

    return run(ctx)


def deep_step(ctx: Context) -> str | None:
    """``--deep`` (:mod:`ckptctl.verify.deep`, imported only when it runs: it brings hashing and
    its reader threads)."""
    if not ctx.options.deep:
        return DEEP_NOT_ASKED
    from ckptctl.verify.deep import deep_step as run

    return run(ctx)


def scan_file(ctx: Context) -> str | None:
    """A single weights file: layout's one family of it (nothing is opened here)."""
    name = ctx.result.root
    try:
        os.stat(name)
        ctx.layout = L.scan(name, reading=ctx.reading)
    except OSError as exc:
        ctx.stop(Path(name).name, exc)
    return None


CONFIG = "config"
# The model class the checkpoint's library builds (on the meta device) judged by its own loader:
# before the config rules, which leave to it what it decides (verify.classes).
MODEL_CLASS = "model-class"
DIRECTORY_STEPS: tuple[Check, ...] = (
    Check("screen", scan_directory), Check("layout", layout_findings), Check("weights", weights_step),
    Check(MODEL_CLASS, model_class_step), Check(CONFIG, config_step), Check("consistency", consistency_step),
    Check("adapter", adapter_step), Check("components", components_step), Check("manifest", manifest_step),
    Check("deep", deep_step))
COMPONENT_STEPS: tuple[Check, ...] = tuple(c for c in DIRECTORY_STEPS if c.run is not components_step
                                           and c.run is not manifest_step)
FILE_STEPS: tuple[Check, ...] = (Check("layout", scan_file), Check("weights", weights_step),
                                 Check("deep", deep_step))
# Every check group, in the order results list them.
GROUPS: tuple[str, ...] = tuple(dict.fromkeys(c.group for c in DIRECTORY_STEPS + FILE_STEPS))
NOT_FOR_FILE = "not run on a single weights file"
NOT_READ = "the path could not be read: io.error"


def _run(ctx: Context, steps: tuple[Check, ...]) -> None:
    for check in steps:
        ctx.mark(check.group, check.run(ctx))
        if ctx.stopped:
            return


def checks_of(marks: dict[str, str | None], not_run: str) -> Checks:
    """The :class:`Checks` of a path from its context's marks; a group no step of the path marked
    did not run for ``not_run``."""
    return Checks(ran=[g for g in GROUPS if g in marks and marks[g] is None],
                  skipped={g: marks.get(g) or not_run for g in GROUPS if marks.get(g, not_run) is not None})


# --------------------------------------------------------------------------------------------
# entry points


def verify_paths(paths: list[str], *, recursive: bool = False, options: VerifyOptions | None = None,
                 progress: ProgressFn | None = None) -> Report:
    """Verify each path (a directory, a file, or a repo id in the local HF cache).

    With ``recursive`` every path is a root and every checkpoint below it is verified. Raises
    :class:`CkptctlError` (exit 2) for a missing path or a root without checkpoints; every problem
    *in* a checkpoint is a finding.
    """
    from ckptctl.resolve import resolve_path

    opts = options or VerifyOptions()
    if not paths:
        raise UsageError("no path given", "pass one or more checkpoint paths, or --recursive ROOT")
    targets: list[tuple[str, Path]] = []
    unread_results: list[PathResult] = []
    for text in paths:
        p = resolve_path(text)
        if recursive:
            if not p.is_dir():
                raise UsageError(f"--recursive needs a directory, {text} is not one", "drop --recursive to "
                                 "verify a single file")
            unreadable: list[tuple[Path, OSError]] = []
            found = discover(p, unreadable)
            for bad, exc in unreadable:
                res = PathResult(path=str(bad), root=str(bad), checks=checks_of({}, NOT_READ))
                res.findings.append(Finding(IO_CODE, ERROR, str(bad), f"cannot read directory {bad}: "
                                            f"{exc.strerror or exc}; checkpoints below it are not verified",
                                            "fix its permissions, or run verify as a user who can read it"))
                unread_results.append(res)
            if not found and not unreadable:
                raise InputError(f"no checkpoints below {text}", "a checkpoint is a folder holding *.safetensors, "
                                 "pytorch_model*.bin, adapter_model.* or DCP files")
            targets.extend((str(f), f) for f in found)
        else:
            _check_target(p)
            targets.append((text, p))
    base_root = _resolve_base(opts.base) if opts.base else None
    results = [verify_path(p, display=text, options=opts, progress=progress, base_root=base_root)
               for text, p in targets]
    return Report(results + unread_results, deep=opts.deep)


def discover(root: Path, unreadable: list[tuple[Path, OSError]] | None = None) -> list[Path]:
    """Every directory at or below ``root`` that holds checkpoint weights, or that a located
    source kind is (``sources/kinds.locate``: a ZeRO root, a Megatron ``--save`` root, even
    without HF weights beside them; the folder such a root points to is verified with it, not
    again on its own). Symlinks not followed; hidden and staging directories skipped. A directory
    that cannot be listed is appended to ``unreadable`` with its error (never silently skipped)."""
    from ckptctl.sources import kinds

    out: list[Path] = []
    part_of: set[Path] = set()  # folders a located root found above them reads

    def onerror(exc: OSError) -> None:
        if unreadable is not None:
            unreadable.append((Path(exc.filename), exc))

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not N.leftover_kind(d, is_dir=True))
        here = Path(dirpath)
        if here in part_of:
            continue
        try:
            found = kinds.locate(here)
            located = found is not None
        except kinds.KindError:  # damaged: verify says how
            found, located = None, True
        if found is not None and getattr(found.location, "folder", here) != here:
            part_of.add(found.location.folder)
        if located or any(N.is_weights_like(n) and not N.leftover_kind(n, is_dir=False) for n in filenames):
            out.append(here)
    return sorted(out)


def _marks_directory(name: str) -> bool:
    """A file that stands for its directory: an index, DCP's .metadata, adapter_config.json."""
    return bool(N.parse_index_name(name)) or name.endswith(N.INDEX_SUFFIXES) or name in (N.DCP_METADATA,
                                                                                         N.ADAPTER_CONFIG)


def _check_target(p: Path) -> None:
    """Refuse, before any work, a file that is not a checkpoint file (usage error)."""
    if p.is_dir() or _marks_directory(p.name) or not p.exists():
        return
    L.scan(p)  # a single file: layout refuses a name it does not know (nothing is opened)


def _resolve_base(text: str) -> Path:
    from ckptctl.resolve import resolve_path

    try:
        p = resolve_path(text)
    except InputError as exc:
        raise UsageError(f"--base: {exc.message}", exc.hint) from None
    if not p.is_dir():
        raise UsageError(f"--base must be a model directory, {text} is not one", "pass the base model's folder")
    return p


def verify_path(path: str | os.PathLike[str], *, display: str | None = None, options: VerifyOptions | None = None,
                progress: ProgressFn | None = None, base_root: Path | None = None) -> PathResult:
    """All checks of one checkpoint directory or file."""
    opts = options or VerifyOptions()
    p = Path(path)
    shown = display or str(p)
    if progress:
        progress("path", shown, 0)
    if not p.is_dir():
        if _marks_directory(p.name):
            p = p.parent
        elif not (p.exists() or p.is_symlink()):
            raise InputError(f"no such file or directory: {p}", "check the path")
    # A checkpoint of 92k tensors makes about a million objects, none in a cycle, that live until
    # its result is made: the cyclic collector would traverse them again and again (a tenth of
    # the run). It resumes once _checked has returned and reference counting has freed them.
    with paused():  # one version of a directory a publish replaces (layout.version): read again if it was
        return one_version(p, lambda _: _checked(PathResult(path=shown, root=str(p)), p, opts, progress, base_root))


def _checked(res: PathResult, p: Path, opts: VerifyOptions, progress: ProgressFn | None,
             base_root: Path | None) -> PathResult:
    is_dir = p.is_dir()
    # a verify's own reading works out its config rules' facts from a large index beside the headers
    reading = opts.reading if opts.reading is not None else MetadataReading(names_work=name_facts)
    ctx = Context(p if is_dir else p.parent, res, opts, progress, base_root, reading)
    _run(ctx, DIRECTORY_STEPS if is_dir else FILE_STEPS)
    res.checks = checks_of(ctx.checks, NOT_READ if ctx.stopped else NOT_FOR_FILE)
    res.findings.sort(key=lambda f: (-SEVERITY_RANK[f.severity], f.path, f.code, f.tensor or ""))
    return res

