"""What a path holds: weight families, extras, leftovers and ambiguities.

Recognises a single ``.safetensors`` file; single-file and sharded safetensors checkpoints;
PyTorch pickles (``pytorch_model.bin``, sharded with an index, ``.pt``/``.pth``); PEFT adapters;
torch DCP directories; the non-weight extras; and temp/staging leftovers. Anything ambiguous is
reported as a finding, never resolved by a silent guess.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ckptctl.errors import InputError
from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format.index import read_index

SAFETENSORS = "safetensors"
PYTORCH = "pytorch"
PEFT = "peft"
DCP = "dcp"

ST_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"

# Files of one weights family: model.safetensors, model-00001-of-00002.safetensors, ...
WEIGHT_NAME = re.compile(
    r"^(?P<stem>model|pytorch_model|adapter_model)(?:\.(?P<variant>[A-Za-z0-9_]+))?"
    r"(?:-(?P<i>\d{5})-of-(?P<n>\d{5}))?\.(?P<ext>safetensors|bin)$"
)
SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|bin)$")

# Names other tools (and crashed writers) leave behind. Matched against a directory entry's name.
LEFTOVER_PATTERNS: dict[str, tuple[str, ...]] = {
    "temp-shards": ("*-of-?????.safetensors", "*-of-?????.bin"),  # literal '?', mcore-bridge
    "staging": ("_tmp_*",),  # ckptctl's and Miles' staging directories
    "safetensors-tmp": (".tmp*",),  # safetensors >= 0.8 NamedTempFile
    "incomplete": ("*.incomplete",),  # huggingface_hub partial downloads
    "trainer-tmp": ("tmp-checkpoint-*",),  # transformers Trainer staging
    "orbax": ("*.orbax-checkpoint-tmp*",),
}

EXTRA_NAMES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "spiece.model", "sentencepiece.bpe.model", "adapter_config.json",
    "README.md",
})
# Extras copied by export from a source directory (README is the user's, not the model's).
COPIED_EXTRAS = EXTRA_NAMES - {"README.md"}


def is_leftover(name: str) -> str | None:
    """The leftover preset a name matches (literal '?' in temp shard names), or None."""
    if "?????" in name and (name.endswith(".safetensors") or name.endswith(".bin")):
        return "temp-shards"
    for preset, patterns in LEFTOVER_PATTERNS.items():
        if preset == "temp-shards":
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return preset
    return None


@dataclass
class Family:
    """One set of weight files that together form a checkpoint."""

    kind: str  # safetensors | pytorch | peft | dcp
    files: list[str]  # data files, relative to the layout root (a file source: its own name)
    index: str | None = None
    container: str = SAFETENSORS  # safetensors | pytorch | dcp

    @property
    def all_files(self) -> list[str]:
        return self.files + ([self.index] if self.index else [])


@dataclass
class Layout:
    root: Path  # the directory (for a single file: its parent)
    single_file: str | None = None  # the file, when the path given was a file
    families: list[Family] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def family(self, kind: str) -> Family | None:
        return next((f for f in self.families if f.kind == kind), None)

    @property
    def weight_files(self) -> set[str]:
        return {name for fam in self.families for name in fam.all_files}

    def primary(self, prefer: str | None = None) -> Family:
        """The one family a command should read; raises when there is none or it is ambiguous."""
        fams = self.families
        if prefer:
            chosen = [f for f in fams if f.kind == prefer]
            if not chosen:
                raise InputError(f"{self.root} holds no {prefer} weights",
                                 f"run `ckptctl inspect {self.root}` to see what it holds")
            return chosen[0]
        if not fams:
            raise InputError(f"{self.root} holds no checkpoint weights (no safetensors, .bin, adapter or DCP files)",
                             "pass a checkpoint directory or a weights file")
        if len(fams) == 1:
            return fams[0]
        kinds = {f.kind for f in fams}
        if PEFT in kinds and len(kinds) == 2 and len(fams) == 2:
            other = next(f for f in fams if f.kind != PEFT)
            raise InputError(f"{self.root} holds both a PEFT adapter and {other.kind} model weights",
                             f"choose one with --only {PEFT} or --only {other.kind}")
        raise InputError(f"{self.root} holds several weight families: {', '.join(sorted(kinds))}",
                         "choose one with --only, or repair the directory with `ckptctl resave --repair`")


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
    if names is not None:
        return _scan_dir(p, sorted(names))
    try:
        names = sorted(os.listdir(p))
    except OSError as exc:
        raise InputError(f"cannot list {p}: {exc.strerror}", "check the directory's permissions") from None
    return _scan_dir(p, names)


def _regular(root: Path, name: str) -> bool:
    """A regular file after following links (an HF cache snapshot links into ../../blobs), so
    reading it cannot block like a FIFO or a device would."""
    import stat

    try:
        return stat.S_ISREG(os.stat(root / name).st_mode)
    except OSError:
        return False


def _scan_file(p: Path) -> Layout:
    lay = Layout(root=p.parent, single_file=p.name)
    name = p.name
    if name.endswith(".safetensors"):
        lay.families.append(Family(SAFETENSORS, [name]))
    elif name.endswith((".bin", ".pt", ".pth", ".ckpt")):
        lay.families.append(Family(PYTORCH, [name], container=PYTORCH))
    elif name.endswith(".safetensors.index.json"):
        return _scan_dir(p.parent, sorted(os.listdir(p.parent)))
    else:
        raise InputError(f"{p} is not a checkpoint file (expected .safetensors, .bin, .pt or .pth)",
                         "pass a weights file or a checkpoint directory")
    return lay


def _scan_dir(root: Path, names: list[str]) -> Layout:
    lay = Layout(root=root)
    claimed: set[str] = set()
    shown = str(root)

    # Leftovers first: a temp shard must never count as a weights file.
    for n in names:
        if is_leftover(n):
            lay.leftovers.append(n)
            claimed.add(n)
            _add(lay, "layout.leftover", WARNING, str(root / n),
                 f"{n} looks like a leftover of an interrupted write", "remove it with `ckptctl gc-tmp` or "
                 "`ckptctl resave --repair`; an upload would push it")

    def sharded(stem: str, ext: str, index_name: str, kind: str, container: str) -> None:
        pattern = re.compile(rf"^{re.escape(stem)}-(\d{{5}})-of-(\d{{5}})\.{ext}$")
        shard_files = [n for n in names if pattern.match(n) and n not in claimed]
        single = f"{stem}.{ext}"
        has_index = index_name in names
        has_single = single in names
        if has_index and not _regular(root, index_name):
            _add(lay, "layout.unsafe_index", ERROR, str(root / index_name),
                 f"{index_name} is not a regular file (a directory, FIFO, device or dangling link)",
                 "replace it with a real index: `ckptctl resave --repair` rebuilds it from the shard headers")
            claimed.add(index_name)
            has_index = False
        if has_index:
            idx = read_index(root / index_name, display=str(root / index_name))
            # A broken index is reported, never silently replaced by a directory listing.
            lay.findings.extend(idx.findings)
            indexed = idx.shards  # sorted once: the property rebuilds it on every access
            present = set(names)
            files = [s for s in indexed if "/" not in s and "\\" not in s and s != ".." and s in present]
            kept = set(files)
            for s in indexed:
                if s not in kept:
                    _add(lay, "layout.shard_missing", ERROR, str(root / index_name),
                         f"{index_name} names {s!r}, which is not a file in {root}",
                         "restore the shard (download or export it again), or rebuild the index with "
                         "`ckptctl resave --repair`")
            if not idx.ok:
                files = shard_files
            unref = [n for n in shard_files if n not in set(indexed)] if idx.ok else []
            for n in unref:
                _add(lay, "layout.unreferenced_shard", ERROR, str(root / n),
                     f"{n} is not named by {index_name}", "run `ckptctl resave --repair` to remove it")
            lay.families.append(Family(kind, files or shard_files, index=index_name, container=container))
            claimed.update(shard_files)
            claimed.update(files)
            claimed.add(index_name)
            if has_single:
                _add(lay, "layout.index_and_single", ERROR, shown,
                     f"both {single} and {index_name} are present; loaders disagree on which wins",
                     "keep one with `ckptctl resave --repair --prefer index|single`")
                lay.families.append(Family(kind, [single], container=container))
                claimed.add(single)
        elif shard_files:
            _add(lay, "layout.missing_index", ERROR, shown,
                 f"{len(shard_files)} {stem} shards but no {index_name}",
                 "run `ckptctl resave --repair` to rebuild the index from the shard headers")
            lay.families.append(Family(kind, shard_files, container=container))
            claimed.update(shard_files)
            if has_single:
                lay.families.append(Family(kind, [single], container=container))
                claimed.add(single)
        elif has_single:
            lay.families.append(Family(kind, [single], container=container))
            claimed.add(single)

    sharded("model", "safetensors", ST_INDEX, SAFETENSORS, SAFETENSORS)
    sharded("pytorch_model", "bin", PT_INDEX, PYTORCH, PYTORCH)

    # PEFT adapter
    adapter_cfg = "adapter_config.json" in names
    for fname, container in (("adapter_model.safetensors", SAFETENSORS), ("adapter_model.bin", PYTORCH)):
        if fname in names:
            lay.families.append(Family(PEFT, [fname], container=container))
            claimed.add(fname)
            if not adapter_cfg:
                _add(lay, "layout.adapter_without_config", ERROR, str(root / fname),
                     f"{fname} without adapter_config.json", "copy the adapter_config.json that belongs to it")

    # torch DCP
    distcp = [n for n in names if n.endswith(".distcp")]
    if ".metadata" in names or distcp:
        lay.families.append(Family(DCP, distcp, index=".metadata" if ".metadata" in names else None,
                                   container=DCP))
        claimed.update(distcp)
        claimed.add(".metadata")
        if ".metadata" not in names:
            _add(lay, "layout.dcp_without_metadata", ERROR, shown, "*.distcp files without .metadata",
                 "the DCP save did not finish: save it again")

    # Any other weights: a lone non-standard .safetensors or .pt file.
    for n in names:
        if n in claimed or n in EXTRA_NAMES:
            continue
        if n.endswith(".safetensors") and (root / n).is_file():
            _add(lay, "layout.unrecognised_weights", ERROR if lay.family(SAFETENSORS) else WARNING,
                 str(root / n), f"{n} is a safetensors file outside the checkpoint's naming scheme",
                 "rename it, or remove it if it is stale: loaders that glob *.safetensors will pick it up")
            if not lay.family(SAFETENSORS):
                lay.families.append(Family(SAFETENSORS, [n]))
                claimed.add(n)
        elif n.endswith((".pt", ".pth")) and (root / n).is_file() and not lay.families:
            lay.families.append(Family(PYTORCH, [n], container=PYTORCH))
            claimed.add(n)

    kinds = [f.kind for f in lay.families]
    model_kinds = {k for k in kinds if k != PEFT}
    if SAFETENSORS in model_kinds and PYTORCH in model_kinds:
        _add(lay, "layout.two_families", ERROR, shown,
             "both safetensors and pytorch_model*.bin weights are present",
             "keep one with `ckptctl resave --repair --prefer safetensors` (an upload would push both)")
    if kinds.count(PEFT) > 1:
        _add(lay, "layout.two_adapters", ERROR, shown, "both adapter_model.safetensors and adapter_model.bin",
             "remove the stale one")
    if PEFT in kinds and model_kinds:
        _add(lay, "layout.adapter_beside_model", INFO, shown,
             "a PEFT adapter sits beside full model weights", None)

    for n in names:
        if n in claimed:
            continue
        (lay.extras if n in EXTRA_NAMES else lay.others).append(n)
    return lay
