"""What a path holds: weight families, extras, leftovers and ambiguities. The one model of a
checkpoint directory that every command reads.

A *family* is one set of weights files that together form a checkpoint: a single file, or shards
with their index. Files are grouped by their library name (``ckptctl.format.names``): stem
(``model``, ``pytorch_model``, ``diffusion_pytorch_model``, ``adapter_model``), container
(safetensors or pickle) and variant (``model.fp16.safetensors``). Each index is parsed here, once,
and kept on its family (``Family.index_doc``) with its findings in ``Layout.findings``; nobody
re-reads it. torch DCP directories, lone ``.pt`` files and stray ``*.safetensors`` files are
families too. Anything ambiguous is reported as a finding, never resolved by a silent guess;
:func:`choose` is the one policy that picks a family where a command must read one.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ckptctl.errors import InputError, UnrepairableError, UsageError
from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format import names as N
from ckptctl.format.index import Index, read_index

MODEL = "model"  # a directory with one model's weights
PIPELINE = "diffusers-pipeline"  # model_index.json + component folders
SENTENCE_TRANSFORMERS = "sentence-transformers"  # modules.json + module folders
MODEL_INDEX = "model_index.json"
MODULES_JSON = "modules.json"
_MAX_MANIFEST = 1 << 20  # model_index.json / modules.json are a few hundred bytes

SAFETENSORS = "safetensors"
PYTORCH = "pytorch"
PEFT = "peft"
DCP = "dcp"

ST_INDEX = N.index_name("model", N.SAFETENSORS_EXT)
PT_INDEX = N.index_name("pytorch_model", N.BIN_EXT)

EXTRA_NAMES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "spiece.model", "sentencepiece.bpe.model", "adapter_config.json",
    "README.md",
})
# Extras copied by export from a source directory (README is the user's, not the model's).
COPIED_EXTRAS = EXTRA_NAMES - {"README.md"}

# Stems whose safetensors and pickle families hold the same model (they compete).
_SLOT = {"model": "model", "pytorch_model": "model", "diffusion_pytorch_model": "diffusion_pytorch_model",
         "adapter_model": "adapter_model"}


def is_leftover(name: str, *, is_dir: bool | None = None) -> str | None:
    """The leftover kind a directory entry's name is (see ``names.LEFTOVERS``), or None. Without
    ``is_dir`` the name is tried as a file and as a directory."""
    kinds = (False, True) if is_dir is None else (is_dir,)
    for d in kinds:
        kind = N.leftover_kind(name, is_dir=d)
        if kind:
            return kind
    return None


@dataclass
class Family:
    """One set of weight files that together form a checkpoint."""

    kind: str  # safetensors | pytorch | peft | dcp
    files: list[str]  # data files, relative to the layout root (a file source: its own name)
    index: str | None = None
    container: str = SAFETENSORS  # safetensors | pytorch | dcp
    stem: str | None = None  # the library's name (names.STEMS); None for DCP and stray files
    variant: str | None = None  # model.<variant>.safetensors
    index_doc: Index | None = field(default=None, repr=False)  # the parsed index, read once by scan

    @property
    def all_files(self) -> list[str]:
        return self.files + ([self.index] if self.index else [])

    @property
    def sharded(self) -> bool:
        return self.index is not None or len(self.files) > 1

    @property
    def slot(self) -> tuple[str, str | None]:
        """Families in the same slot hold the same model: at most one may be live."""
        if self.stem:
            return _SLOT[self.stem], self.variant
        return ("model" if self.kind in (SAFETENSORS, PYTORCH) else self.kind), self.variant

    def describe(self) -> str:
        if self.index:
            return f"{self.index} ({len(self.files)} shards)"
        return ", ".join(self.files) if len(self.files) <= 3 else f"{len(self.files)} files"


@dataclass
class Component:
    """One component of a multi-component root, as its manifest (``model_index.json`` or
    ``modules.json``) names it."""

    name: str  # diffusers: the pipeline attribute ("unet"); sentence-transformers: the module name
    path: str  # folder relative to the root ("" for a sentence-transformers root module)
    library: str | None  # diffusers | transformers | sentence_transformers | ...
    cls: str | None  # the class the library instantiates
    layout: Layout | None = None  # None when the folder is missing or unsafe (a finding says so)

    @property
    def has_weights(self) -> bool:
        return self.layout is not None and bool(self.layout.families)


@dataclass
class Layout:
    root: Path  # the directory (for a single file: its parent)
    single_file: str | None = None  # the file, when the path given was a file
    families: list[Family] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # A multi-component root (diffusers pipeline, sentence-transformers model): ``kind`` says
    # which, ``components`` lists each component with its own layout.
    kind: str = MODEL
    components: list[Component] = field(default_factory=list)

    def family(self, kind: str) -> Family | None:
        """The first family of ``kind`` that is not a variant."""
        return next((f for f in self.families if f.kind == kind and f.variant is None), None)

    @property
    def variants(self) -> list[Family]:
        return [f for f in self.families if f.variant is not None]

    @property
    def weight_files(self) -> set[str]:
        return {name for fam in self.families for name in fam.all_files}

    def primary(self, prefer: str | None = None) -> Family:
        """The one family a command should read; raises when there is none or it is ambiguous."""
        return choose(self, prefer=prefer)


# --------------------------------------------------------------------------------------------
# the one ranking policy


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


# --------------------------------------------------------------------------------------------
# scanning


def _add(lay: Layout, code: str, severity: str, path: str, message: str, hint: str | None = None) -> None:
    lay.findings.append(Finding(code, severity, path, message, hint))


def scan(path: str | os.PathLike[str], *, names: list[str] | None = None) -> Layout:
    """Describe what ``path`` holds. Raises :class:`InputError` when it does not exist.

    ``names`` restricts a directory scan to those entries (verify passes the entries left after
    screening out links that escape the directory)."""
    p = Path(path)
    try:
        is_dir = p.is_dir()
        exists = p.exists()
    except OSError as exc:  # e.g. permission denied on a parent
        raise InputError(f"cannot access {p}: {exc.strerror}", "check the path and its permissions") from None
    if not exists:
        raise InputError(f"no such file or directory: {p}", "check the path (a repo id needs the local HF cache)")
    if not is_dir:
        return _scan_file(p)
    if names is None:
        try:
            names = os.listdir(p)
        except OSError as exc:
            raise InputError(f"cannot list {p}: {exc.strerror}", "check the directory's permissions") from None
    return _Scanner(p, sorted(names)).run()


def _mode(path: Path) -> int | None:
    """st_mode after following links (an HF cache snapshot links into ../../blobs), or None."""
    try:
        return os.stat(path).st_mode
    except OSError:
        return None


def _regular(path: Path) -> bool:
    """A regular file, so reading it cannot block like a FIFO or a device would."""
    m = _mode(path)
    return m is not None and stat.S_ISREG(m)


def _scan_file(p: Path) -> Layout:
    lay = Layout(root=p.parent, single_file=p.name)
    name = p.name
    if name.endswith(".safetensors"):
        w = N.parse_weights_name(name)
        lay.families.append(Family(SAFETENSORS, [name], stem=w.stem if w else None, variant=w.variant if w else None))
    elif name.endswith((".bin", ".pt", ".pth", ".ckpt")):
        lay.families.append(Family(PYTORCH, [name], container=PYTORCH))
    elif N.parse_index_name(name) or name.endswith(N.INDEX_SUFFIXES):
        return scan(p.parent)
    else:
        raise InputError(f"{p} is not a checkpoint file (expected .safetensors, .bin, .pt or .pth)",
                         "pass a weights file or a checkpoint directory")
    return lay


class _Scanner:
    def __init__(self, root: Path, names: list[str]) -> None:
        self.root = root
        self.names = names
        self.present = set(names)
        self.lay = Layout(root=root)
        self.claimed: set[str] = set()

    def run(self) -> Layout:
        self._leftovers()
        self._named_families()
        self._dcp()
        self._strays()
        self._conflicts()
        self._components()
        for n in self.names:
            if n not in self.claimed:
                (self.lay.extras if n in EXTRA_NAMES else self.lay.others).append(n)
        return self.lay

    def _is_dir(self, n: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(self.root / n).st_mode)
        except OSError:
            return False

    def _leftovers(self) -> None:
        """First: a temp shard must never count as a weights file."""
        beside = any(n.endswith(".safetensors") for n in self.names)
        for n in self.names:
            kind = N.leftover_kind(n, is_dir=self._is_dir(n), beside_safetensors=beside)
            if kind:
                self.lay.leftovers.append(n)
                self.claimed.add(n)
                _add(self.lay, "layout.leftover", WARNING, str(self.root / n),
                     f"{n} looks like a leftover of an interrupted write ({kind})",
                     "remove it with `ckptctl gc-tmp` or `ckptctl resave --repair`; an upload would push it")

    def _named_families(self) -> None:
        groups: dict[tuple[str, str, str | None], dict] = {}
        for n in self.names:
            if n in self.claimed:
                continue
            w = N.parse_weights_name(n)
            if w is not None:
                g = groups.setdefault(w.family, {"index": None, "single": None, "shards": []})
                if w.shard:
                    g["shards"].append(n)
                else:
                    g["single"] = n
                continue
            ix = N.parse_index_name(n)
            if ix is not None:
                groups.setdefault(ix, {"index": None, "single": None, "shards": []})["index"] = n
        order = {"model": 0, "pytorch_model": 1, "diffusion_pytorch_model": 2, "adapter_model": 3}
        for key in sorted(groups, key=lambda k: (order[k[0]], k[1] != "safetensors", k[2] or "")):
            self._family(key, **groups[key])

    def _family(self, key: tuple[str, str, str | None], *, index: str | None, single: str | None,
                shards: list[str]) -> None:
        stem, ext, variant = key
        kind = PEFT if stem == N.ADAPTER_STEM else (SAFETENSORS if ext == N.SAFETENSORS_EXT else PYTORCH)
        container = SAFETENSORS if ext == N.SAFETENSORS_EXT else PYTORCH
        shown = str(self.root)
        lay = self.lay

        def fam(files: list[str], index: str | None = None, doc: Index | None = None) -> None:
            lay.families.append(Family(kind, files, index=index, container=container, stem=stem, variant=variant,
                                       index_doc=doc))
            self.claimed.update(files)
            if index:
                self.claimed.add(index)

        if index is not None and not _regular(self.root / index):
            _add(lay, "layout.unsafe_index", ERROR, str(self.root / index),
                 f"{index} is not a regular file (a directory, FIFO, device or dangling link)",
                 "replace it with a real index: `ckptctl resave --repair` rebuilds it from the shard headers")
            self.claimed.add(index)
            index = None
        if index is not None:
            doc = read_index(self.root / index, display=str(self.root / index))
            lay.findings.extend(doc.findings)  # a broken index is reported, never silently replaced
            files = self._indexed_files(index, doc) if doc.ok else []
            if doc.ok:
                named = set(doc.weight_map.values())
                for n in shards:
                    if n not in named:
                        _add(lay, "layout.unreferenced_shard", ERROR, str(self.root / n),
                             f"{n} is not named by {index}", "run `ckptctl resave --repair` to remove it")
            fam(files or shards, index, doc)
            self.claimed.update(shards)
            if single:
                _add(lay, "layout.index_and_single", ERROR, shown,
                     f"both {single} and {index} are present; loaders disagree on which wins",
                     "keep one with `ckptctl resave --repair --prefer index|single`")
                fam([single])
            return
        if shards:
            _add(lay, "layout.missing_index", ERROR, shown,
                 f"{len(shards)} {N.weights_file_name(stem, ext, variant=variant)} shards but no "
                 f"{N.index_name(stem, ext, variant=variant)}",
                 "run `ckptctl resave --repair` to rebuild the index from the shard headers")
            fam(shards)
        if single:
            fam([single])
            if stem == N.ADAPTER_STEM and N.ADAPTER_CONFIG not in self.present:
                _add(lay, "layout.adapter_without_config", ERROR, str(self.root / single),
                     f"{single} without adapter_config.json", "copy the adapter_config.json that belongs to it")

    def _indexed_files(self, index: str, doc: Index) -> list[str]:
        """The shards an index names that are safe member names and regular files."""
        files = []
        for s in doc.shards:
            why = N.member_problem(s)
            if why is None and _regular(self.root / s):
                files.append(s)
                continue
            detail = f" ({why})" if why else ""
            _add(self.lay, "layout.shard_missing", ERROR, str(self.root / index),
                 f"{index} names {s!r}, which is not a file in {self.root}{detail}",
                 "restore the shard (download or export it again), or rebuild the index with "
                 "`ckptctl resave --repair`")
        return files

    def _dcp(self) -> None:
        distcp = [n for n in self.names if n.endswith(N.DCP_SUFFIX) and n not in self.claimed]
        has_meta = N.DCP_METADATA in self.present
        if not (has_meta or distcp):
            return
        self.lay.families.append(Family(DCP, distcp, index=N.DCP_METADATA if has_meta else None, container=DCP))
        self.claimed.update(distcp)
        self.claimed.add(N.DCP_METADATA)
        if not has_meta:
            _add(self.lay, "layout.dcp_without_metadata", ERROR, str(self.root), "*.distcp files without .metadata",
                 "the DCP save did not finish: save it again")

    def _strays(self) -> None:
        """Other weights: a lone non-standard .safetensors file, or a .pt file."""
        lay = self.lay
        for n in self.names:
            if n in self.claimed or n in EXTRA_NAMES:
                continue
            if n.endswith(".safetensors") and _regular(self.root / n):
                has_st = lay.family(SAFETENSORS) is not None
                _add(lay, "layout.unrecognised_weights", ERROR if has_st else WARNING, str(self.root / n),
                     f"{n} is a safetensors file outside the checkpoint's naming scheme",
                     "rename it, or remove it if it is stale: loaders that glob *.safetensors will pick it up")
                if not has_st:
                    lay.families.append(Family(SAFETENSORS, [n]))
                    self.claimed.add(n)
            elif n.endswith((".pt", ".pth")) and _regular(self.root / n) and not lay.families:
                lay.families.append(Family(PYTORCH, [n], container=PYTORCH))
                self.claimed.add(n)

    def _conflicts(self) -> None:
        lay, shown = self.lay, str(self.root)
        by_slot: dict[tuple[str, str | None], set[str]] = {}
        for f in lay.families:
            by_slot.setdefault(f.slot, set()).add(f.container)
        for (slot, variant), containers in sorted(by_slot.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            if {SAFETENSORS, PYTORCH} <= containers:
                if slot == "adapter_model":
                    _add(lay, "layout.two_adapters", ERROR, shown,
                         "both adapter_model.safetensors and adapter_model.bin", "remove the stale one")
                else:
                    what = f"{slot}.{variant}" if variant else slot
                    _add(lay, "layout.two_families", ERROR, shown,
                         f"both safetensors and pickle ({what}*.bin) weights are present",
                         "keep one with `ckptctl resave --repair --prefer safetensors` (an upload would push both)")
        kinds = {f.kind for f in lay.families}
        if PEFT in kinds and kinds - {PEFT}:
            _add(lay, "layout.adapter_beside_model", INFO, shown, "a PEFT adapter sits beside full model weights")

    # multi-component roots -------------------------------------------------------------------
    def _components(self) -> None:
        lay = self.lay
        if MODEL_INDEX in self.present:
            entries = _pipeline_components(self._manifest(MODEL_INDEX, dict))
            lay.kind = PIPELINE
        elif MODULES_JSON in self.present:
            entries = _st_modules(self._manifest(MODULES_JSON, list))
            lay.kind = SENTENCE_TRANSFORMERS
        else:
            return
        for name, path, library, cls in entries:
            comp = Component(name, path, library, cls)
            lay.components.append(comp)
            if path == "":
                continue  # the root module: its weights are the root's own families
            why = N.member_problem(path)
            where = self.root / path
            if why is None:
                try:
                    st = os.lstat(where)
                except OSError:
                    why = "it does not exist"
                else:
                    why = None if stat.S_ISDIR(st.st_mode) else "it is not a directory (links are not followed)"
            if why is not None:
                _add(lay, "layout.component_missing", ERROR, str(where),
                     f"component {name!r} lives in {path!r}, but {why}",
                     "restore the component's folder from the save that wrote it, or fix "
                     f"{MODEL_INDEX if lay.kind == PIPELINE else MODULES_JSON}")
                continue
            comp.layout = scan(where)
            self.claimed.add(path.split("/", 1)[0])

    def _manifest(self, name: str, want: type) -> object:
        """A small JSON manifest, read with a bound; malformed is a finding and reads as empty."""
        import json

        path = self.root / name
        try:
            if not _regular(path) or os.path.getsize(path) > _MAX_MANIFEST:
                raise ValueError("not a regular file of at most 1 MiB")
            with open(path, "rb") as f:
                doc = json.loads(f.read(_MAX_MANIFEST + 1))
            if not isinstance(doc, want):
                raise ValueError(f"not a JSON {'object' if want is dict else 'array'}")
        except (OSError, ValueError, RecursionError) as exc:
            _add(self.lay, "layout.bad_component_manifest", ERROR, str(path), f"{name} is unreadable: {exc}",
                 "restore it from the save that wrote it")
            return want()
        return doc


def _pipeline_components(doc: object) -> list[tuple[str, str, str | None, str | None]]:
    """diffusers' model_index.json: every public key whose value is ``[library, class]`` with a
    library is a component in the folder of the same name (``[null, null]`` is an absent one)."""
    out = []
    for key, value in sorted(doc.items()) if isinstance(doc, dict) else ():
        if key.startswith("_") or not (isinstance(value, list) and len(value) == 2):
            continue
        library, cls = value
        if isinstance(library, str) and isinstance(cls, str):
            out.append((key, key, library, cls))
    return out


def _st_modules(doc: object) -> list[tuple[str, str, str | None, str | None]]:
    """sentence-transformers' modules.json: a list of ``{"name", "path", "type"}``."""
    out = []
    for m in doc if isinstance(doc, list) else ():
        if isinstance(m, dict) and isinstance(m.get("path"), str):
            typ = m.get("type") if isinstance(m.get("type"), str) else None
            out.append((str(m.get("name", m["path"])), m["path"].rstrip("/"), "sentence_transformers", typ))
    return out
