"""``verify``: every check of a checkpoint path, returned as a :class:`Report` of findings.

Checks, by level (codes are documented in ``docs/VERIFY_CODES.md``):

* header: every rule of :mod:`ckptctl.format.header` on every safetensors file, plus dtype notes;
* directory: layout ambiguities (:mod:`ckptctl.layout`), leftovers an upload would push, symlinks
  that resolve outside the checkpoint (never opened), the index against the shard headers in both
  directions, shard numbering, ``total_size``/``total_parameters``, alias records, variants;
* config.json and adapter_config.json against the tensors (:mod:`ckptctl.verify_config`);
* PyTorch pickles and DCP metadata, statically (:mod:`ckptctl.verify_pickle`);
* the ckptctl manifest (sizes; with ``deep`` also sha256);
* ``deep``: every byte read once, hashed, floats checked (:mod:`ckptctl.verify_deep`).

Nothing here prints: progress goes to an optional callback. torch is imported only for DCP
directories; safetensors checkpoints (with or without ``deep``) and ``.bin`` files never import it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ckptctl import layout as L
from ckptctl.format.names import parse_shard_number, parse_weights_name
from ckptctl.errors import CkptctlError, InputError, UsageError
from ckptctl.findings import ERROR, INFO, SEVERITY_RANK, WARNING, Finding
from ckptctl.format import dtypes as dt
from ckptctl.format.header import Header, read_header
from ckptctl.format.index import read_index
from ckptctl.manifest import MANIFEST_NAME, read_manifest
from ckptctl.verify_config import TensorMeta, check_adapter, check_config

__all__ = ["SCHEMA_VERSION", "PathResult", "Report", "TensorMeta", "VerifyOptions", "discover", "verify_path",
           "verify_paths"]

SCHEMA_VERSION = 1
IO_CODE = "io.error"
# (event, path, amount): "path" (a checkpoint starts), "file" (amount = bytes to read), "bytes", "done".
ProgressFn = Callable[[str, str, int], None]

# Header findings after which the header holds no tensor list at all.
_UNPARSED = frozenset({"header.lfs_pointer", "header.html_page", "header.too_small", "header.too_large",
                       "header.length_exceeds_file", "header.not_utf8", "header.not_object",
                       "header.duplicate_key", "header.bad_json"})
_RESERVED_META = frozenset({"format", "total_size", "total_parameters"})
_VARIANT_FILE = re.compile(r"^model\.(?P<v>[A-Za-z0-9_]+)(?:-(?P<i>\d{5})-of-(?P<n>\d{5}))?\.safetensors$")
_VARIANT_INDEX = re.compile(r"^model\.(?P<v>[A-Za-z0-9_]+)\.safetensors\.index\.json$")
_EXTRA_LEFTOVERS = ("*.lock",)
_WEIGHTS_LIKE = re.compile(r"(\.safetensors|\.json|\.bin|\.pt|\.pth|\.ckpt|\.distcp)$|^\.metadata$")
_REPAIR = "run `ckptctl resave --repair DIR` to rebuild the index from the shard headers"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer_config.json")


@dataclass
class VerifyOptions:
    deep: bool = False
    base: str | None = None  # base model for adapter checks (path or cached repo id)
    max_shard_size: int | None = None
    chunk_bytes: int = 8 * 1024 * 1024


@dataclass
class FileRecord:
    name: str
    role: str  # weights | index | metadata | config | manifest | extra
    size: int | None = None
    sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "role": self.role, "size": self.size}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out


@dataclass
class PathResult:
    path: str  # as the user gave it
    root: str  # the resolved file or directory
    kind: str = "none"
    findings: list[Finding] = field(default_factory=list)
    files: list[FileRecord] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0

    @property
    def io_error(self) -> bool:
        return any(f.code == IO_CODE for f in self.findings)

    def counts(self) -> dict[str, int]:
        out = {ERROR: 0, WARNING: 0, INFO: 0}
        for f in self.findings:
            out[f.severity] += 1
        return out

    def failed(self, fail_on: str = ERROR) -> bool:
        level = SEVERITY_RANK[fail_on]
        return any(SEVERITY_RANK[f.severity] >= level for f in self.findings)

    def to_dict(self, fail_on: str = ERROR) -> dict[str, Any]:
        return {
            "path": self.path,
            "root": self.root,
            "kind": self.kind,
            "ok": not self.failed(fail_on) and not self.io_error,
            "counts": self.counts(),
            "tensors": self.tensors,
            "bytes_read": self.bytes_read,
            "files": [f.to_dict() for f in self.files],
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass
class Report:
    results: list[PathResult]
    deep: bool = False

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def io_error(self) -> bool:
        return any(r.io_error for r in self.results)

    def failed(self, fail_on: str = ERROR) -> bool:
        return any(r.failed(fail_on) for r in self.results)

    def counts(self) -> dict[str, int]:
        out = {ERROR: 0, WARNING: 0, INFO: 0}
        for r in self.results:
            for k, v in r.counts().items():
                out[k] += v
        return out

    def to_dict(self, fail_on: str = ERROR) -> dict[str, Any]:
        return {
            "fail_on": fail_on,
            "deep": self.deep,
            "summary": {"paths": len(self.results),
                        "failed": sum(1 for r in self.results if r.failed(fail_on) or r.io_error),
                        **self.counts()},
            "results": [r.to_dict(fail_on) for r in self.results],
        }


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
    for text in paths:
        p = resolve_path(text)
        if recursive:
            if not p.is_dir():
                raise UsageError(f"--recursive needs a directory, {text} is not one", "drop --recursive to "
                                 "verify a single file")
            found = discover(p)
            if not found:
                raise InputError(f"no checkpoints below {text}", "a checkpoint is a folder holding *.safetensors, "
                                 "pytorch_model*.bin, adapter_model.* or DCP files")
            targets.extend((str(f), f) for f in found)
        else:
            _check_target(p)
            targets.append((text, p))
    base_root = _resolve_base(opts.base) if opts.base else None
    results = [verify_path(p, display=text, options=opts, progress=progress, base_root=base_root)
               for text, p in targets]
    return Report(results, deep=opts.deep)


def discover(root: Path) -> list[Path]:
    """Every directory at or below ``root`` that holds checkpoint weights (symlinks not followed;
    hidden and staging directories skipped)."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not L.is_leftover(d))
        if any(_is_weights_name(n) for n in filenames):
            out.append(Path(dirpath))
    return sorted(out)


def _is_weights_name(n: str) -> bool:
    return (n.endswith((".safetensors", ".safetensors.index.json", ".bin.index.json", ".distcp"))
            or n in (".metadata", "adapter_config.json") or parse_weights_name(n) is not None) and not L.is_leftover(n)


def verify_path(path: str | os.PathLike[str], *, display: str | None = None, options: VerifyOptions | None = None,
                progress: ProgressFn | None = None, base_root: Path | None = None) -> PathResult:
    """All checks of one checkpoint directory or file."""
    opts = options or VerifyOptions()
    p = Path(path)
    shown = display or str(p)
    if progress:
        progress("path", shown, 0)
    if not p.is_dir():
        name = p.name
        if name.endswith(_DIR_MARKERS) or name in (".metadata", "adapter_config.json"):
            p = p.parent
        elif not (p.exists() or p.is_symlink()):
            raise InputError(f"no such file or directory: {p}", "check the path")
    res = PathResult(path=shown, root=str(p))
    if p.is_dir():
        _Dir(p, res, opts, progress, base_root).run()
    else:
        _verify_file(p, res, opts, progress)
    res.findings.sort(key=lambda f: (-SEVERITY_RANK[f.severity], f.path, f.code, f.tensor or ""))
    return res


_DIR_MARKERS = (".safetensors.index.json", ".bin.index.json")
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _check_target(p: Path) -> None:
    """Refuse, before any work, a file that is not a checkpoint file (usage error)."""
    if p.is_dir() or p.name.endswith(_DIR_MARKERS) or p.name in (".metadata", "adapter_config.json"):
        return
    if not p.name.endswith(_FILE_SUFFIXES):
        raise InputError(f"{p} is not a checkpoint file (expected .safetensors, .bin, .pt or .pth)",
                         "pass a weights file or a checkpoint directory")


def _resolve_base(text: str) -> Path:
    from ckptctl.resolve import resolve_path

    try:
        p = resolve_path(text)
    except InputError as exc:
        raise UsageError(f"--base: {exc.message}", exc.hint) from None
    if not p.is_dir():
        raise UsageError(f"--base must be a model directory, {text} is not one", "pass the base model's folder")
    return p


# --------------------------------------------------------------------------------------------
# helpers


def _bad_name(name: Any) -> str | None:
    """Why a file name taken from a JSON file may not be opened, or None."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if "\0" in name:
        return "it contains a NUL byte"
    if name.startswith("/") or os.path.isabs(name):
        return "it is an absolute path"
    if "\\" in name:
        return "it contains a backslash"
    if re.match(r"^[A-Za-z]:", name):
        return "it has a drive letter"
    if ".." in name.split("/"):
        return "it climbs out of the directory with '..'"
    return None


def _within(real: str, base: str) -> bool:
    try:
        return os.path.commonpath([real, base]) == base
    except ValueError:
        return False


def _allowed_root(root: Path) -> str:
    """The directory symlinks may resolve into: the checkpoint itself, or for a Hugging Face cache
    snapshot (``models--x/snapshots/<rev>``, files linked to ``../../blobs``) the repo's cache folder."""
    real = os.path.realpath(root)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and os.path.isdir(os.path.join(os.path.dirname(parent), "blobs")):
        return os.path.dirname(parent)
    return real


def _dtype_notes(hdr: Header) -> list[Finding]:
    out: list[Finding] = []
    newer: dict[str, str] = {}
    no_torch: list[str] = []
    for t in hdr.tensors.values():
        d = dt.get(t.dtype)
        if d is None:
            continue
        if tuple(int(x) for x in d.since.split(".")) > (0, 4):
            newer[d.name] = d.since
        if d.torch_name is None:
            no_torch.append(t.name)
    if newer:
        need = max(newer.values(), key=lambda s: tuple(int(x) for x in s.split(".")))
        out.append(Finding("header.dtype_min_version", INFO, hdr.path,
                           f"{hdr.path}: dtypes {', '.join(sorted(newer))} need safetensors >= {need} to load",
                           "make sure every consumer has that safetensors version", None,
                           {"dtypes": dict(sorted(newer.items()))}))
    if no_torch:
        out.append(Finding("header.dtype_not_torch", WARNING, hdr.path,
                           f"{hdr.path}: {len(no_torch)} tensors use a dtype torch cannot load (F6_*), e.g. "
                           f"{no_torch[0]!r}", "convert them before loading with safetensors.torch", no_torch[0]))
    return out


def _alias_findings(meta: dict[str, Any], names: set[str], display: str) -> list[Finding]:
    """Alias records ``{removed: kept}`` (huggingface_hub / safetensors ``save_model``) must name a
    tensor that is stored."""
    out: list[Finding] = []
    for k, v in meta.items():
        if k in _RESERVED_META or not isinstance(k, str) or not isinstance(v, str) or k == v:
            continue
        if "." not in k or "." not in v or k.rsplit(".", 1)[1] != v.rsplit(".", 1)[1] or " " in v:
            continue
        if k in names:
            continue
        if v not in names:
            out.append(Finding("metadata.alias_dangling", WARNING, display,
                               f"{display}: metadata records {k!r} as an alias of {v!r}, which is not stored",
                               "re-export the checkpoint: the alias map is stale", k, {"kept": v}))
    return out


def _regular(path: Path) -> tuple[bool, int | None]:
    st = os.stat(path)
    return stat.S_ISREG(st.st_mode), st.st_size


def _tokenizer_size(doc: Any) -> int | None:
    """Highest token id + 1 in a tokenizer.json document."""
    if not isinstance(doc, dict):
        return None
    top = -1
    model = doc.get("model")
    if isinstance(model, dict):
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            ids = [v for v in vocab.values() if isinstance(v, int)]
            top = max(ids, default=-1)
        elif isinstance(vocab, list):
            top = len(vocab) - 1
    for tok in doc.get("added_tokens") or []:
        if isinstance(tok, dict) and isinstance(tok.get("id"), int):
            top = max(top, tok["id"])
    return top + 1 if top >= 0 else None


# --------------------------------------------------------------------------------------------
# single files


def _verify_file(p: Path, res: PathResult, opts: VerifyOptions, progress: ProgressFn | None) -> None:
    shown = str(p)
    try:
        regular, size = _regular(p)
    except OSError as exc:
        res.findings.append(Finding(IO_CODE, ERROR, shown, f"cannot stat {shown}: {exc.strerror}",
                                    "check the path and its permissions"))
        return
    if not regular:
        res.findings.append(Finding("dir.not_a_file", ERROR, shown, f"{shown} is not a regular file",
                                    "pass a weights file or a checkpoint directory"))
        return
    _check_target(p)
    rec = FileRecord(p.name, "weights", size)
    res.files.append(rec)
    hdr: Header | None = None
    try:
        if p.name.endswith(".safetensors"):
            res.kind = "safetensors"
            hdr = read_header(p, display=shown)
            res.findings.extend(hdr.findings)
            res.findings.extend(_dtype_notes(hdr))
            if hdr.metadata:
                res.findings.extend(_alias_findings(hdr.metadata, set(hdr.tensors), shown))
            res.tensors = len(hdr.tensors)
        else:
            from ckptctl.verify_pickle import scan_torch_file

            res.kind = "pytorch"
            scan = scan_torch_file(str(p), shown)
            res.findings.extend(scan.findings)
            res.tensors = len(scan.tensors or {})
        if opts.deep:
            from ckptctl.verify_deep import scan_file

            if progress:
                progress("file", shown, size or 0)
            dr = scan_file(str(p), shown, hdr, chunk_bytes=opts.chunk_bytes,
                           progress=(lambda n: progress("bytes", shown, n)) if progress else None)
            if progress:
                progress("done", shown, 0)
            rec.sha256 = dr.sha256
            res.bytes_read += dr.bytes_read
            res.findings.extend(dr.findings)
    except OSError as exc:
        res.findings.append(Finding(IO_CODE, ERROR, shown, f"cannot read {shown}: {exc.strerror or exc}",
                                    "check the file, its permissions and the storage"))
    except CkptctlError as exc:
        res.findings.append(Finding(IO_CODE, ERROR, shown, exc.message, exc.hint))


# --------------------------------------------------------------------------------------------
# directories


@dataclass
class _Read:
    """One weights file as read: its tensors (None when unreadable) and, for safetensors, its header."""

    names: set[str] | None
    tensors: dict[str, TensorMeta]
    header: Header | None = None


class _Dir:
    def __init__(self, root: Path, res: PathResult, opts: VerifyOptions, progress: ProgressFn | None,
                 base_root: Path | None) -> None:
        self.root = root
        self.res = res
        self.opts = opts
        self.progress = progress
        self.base_root = base_root
        self.allowed = _allowed_root(root)
        self.names: list[str] = []
        self.hidden: set[str] = set()  # entries removed from the view (escaping or broken links)
        self.read: dict[str, _Read] = {}  # per weights file, relative name
        self.deep_queue: dict[str, Header | None] = {}
        self.records: dict[str, FileRecord] = {}
        self.partial: set[int] = set()  # id() of families with a missing or unreadable weights file

    # plumbing ---------------------------------------------------------------------------------
    def disp(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def add(self, code: str, severity: str, path: str, message: str, hint: str | None = None,
            tensor: str | None = None, **details: Any) -> None:
        self.res.findings.append(Finding(code, severity, path, message, hint, tensor, dict(details)))

    def io(self, name: str, exc: BaseException) -> None:
        if isinstance(exc, CkptctlError):
            msg, hint = exc.message, exc.hint
        else:
            err = exc if isinstance(exc, OSError) else None
            msg = f"cannot read {self.disp(name)}: {(err.strerror if err and err.strerror else exc)}"
            hint = "check the file, its permissions and the storage"
        self.add(IO_CODE, ERROR, self.disp(name), msg, hint)

    def record(self, name: str, role: str) -> FileRecord:
        rec = self.records.get(name)
        if rec is None:
            size = None
            try:
                size = os.stat(self.root / name).st_size
            except OSError:
                pass
            rec = self.records[name] = FileRecord(name, role, size)
            self.res.files.append(rec)
        return rec

    def resolve(self, name: str, *, code: str, source: str, what: str) -> Path | None:
        """A file name read from a JSON document: refuse names that leave the directory (by
        syntax or through a symlink) without opening them. Returns the path, which may not exist."""
        why = _bad_name(name)
        if why:
            self.add(code, ERROR, source, f"{source}: {what} {name!r} is refused: {why}",
                     "file names must be relative paths inside the checkpoint directory; fix or rebuild the file",
                     name=name)
            return None
        target = self.root / name
        if name.split("/")[0] in self.hidden:
            return None  # already reported as an escaping or broken symlink
        if os.path.lexists(target) and not _within(os.path.realpath(target), self.allowed):
            self.add("dir.symlink_escape", ERROR, self.disp(name),
                     f"{self.disp(name)} resolves to {os.path.realpath(target)}, outside the checkpoint; not opened",
                     "replace the symlink with the file itself (or a hard link)", name=name)
            self.hidden.add(name)
            return None
        return target

    def listed_file(self, name: str, *, code_outside: str, source: str, what: str, code_missing: str,
                    missing: str, hint_missing: str, hint_not_file: str) -> int | None:
        """Size of a file that a document (DCP metadata, manifest) lists, or None after reporting
        why it cannot be used: outside the directory, missing, unreadable or not a regular file."""
        target = self.resolve(name, code=code_outside, source=source, what=what)
        if target is None:
            return None
        if not os.path.lexists(target):
            self.add(code_missing, ERROR, self.disp(name), f"{name} {missing}", hint_missing, name=name)
            return None
        try:
            regular, size = _regular(target)
        except OSError as exc:
            self.io(name, exc)
            return None
        if not regular:
            self.add("dir.not_a_file", ERROR, self.disp(name), f"{self.disp(name)} is not a regular file",
                     hint_not_file)
            return None
        return size

    def open_json(self, name: str, code_bad: str) -> tuple[bool, Any]:
        """Parse a JSON file of the directory. (False, None) when absent or refused."""
        if name not in self.names:
            return False, None
        self.record(name, "config" if name != MANIFEST_NAME else "manifest")
        try:
            ok, _ = _regular(self.root / name)
            if not ok:
                self.add("dir.not_a_file", ERROR, self.disp(name), f"{self.disp(name)} is not a regular file",
                         "replace it with the file")
                return False, None
            with open(self.root / name, "rb") as f:
                raw = f.read(64 * 1024 * 1024 + 1)
        except OSError as exc:
            self.io(name, exc)
            return False, None
        try:
            return True, json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            self.add(code_bad, ERROR, self.disp(name), f"{self.disp(name)} is not valid JSON ({type(exc).__name__})",
                     "fix the file (or copy it again from the source model)")
            return False, None

    # run --------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.names = sorted(os.listdir(self.root))
        except OSError as exc:
            self.io("", exc)
            return
        self._screen_links()
        view = [n for n in self.names if n not in self.hidden]
        try:
            lay = L.scan(self.root, names=view)  # the view has no escaping links
        except CkptctlError as exc:
            self.io("", exc)
            return
        families, variant_files = self._variants(lay, view)
        self._layout_findings(lay, variant_files)
        if not families:
            self.add("dir.no_weights", ERROR, self.disp(),
                     f"{self.disp()} holds no checkpoint weights (no safetensors, .bin, adapter or DCP files)",
                     "export the checkpoint again; an interrupted save may have removed the old files first")
        kinds = []
        tables: list[tuple[L.Family, dict[str, TensorMeta] | None]] = []
        for fam in families:
            kinds.append(fam.kind)
            if fam.container == L.SAFETENSORS:
                tables.append((fam, self._weights_family(fam, L.SAFETENSORS)))
            elif fam.container == L.PYTORCH:
                tables.append((fam, self._weights_family(fam, L.PYTORCH)))
            elif fam.container == L.DCP:
                self._dcp(fam)
        self.res.kind = self._kind(families)
        self.res.tensors = sum(len(t) for _, t in tables if t)
        self._config(tables)
        self._adapter(tables)
        manifest = self._manifest(lay, families)
        if self.opts.deep:
            self._deep(manifest)

    def _screen_links(self) -> None:
        """Take out of the view (and report) what must never be opened: links that leave the
        checkpoint, dangling links, and FIFOs, sockets, devices or directories under weights names
        (opening a FIFO would block forever)."""
        for n in self.names:
            p = self.root / n
            if not os.path.islink(p):
                try:
                    mode = os.lstat(p).st_mode
                except OSError:
                    continue
                if stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and not _WEIGHTS_LIKE.search(n)):
                    continue
                self.hidden.add(n)
                self.add("dir.not_a_file", ERROR, self.disp(n),
                         f"{self.disp(n)} is a {'directory' if stat.S_ISDIR(mode) else 'special file'}, not a "
                         "regular file; not opened", "replace it with the file it should be")
                continue
            real = os.path.realpath(p)
            if not _within(real, self.allowed):
                self.hidden.add(n)
                self.add("dir.symlink_escape", ERROR, self.disp(n),
                         f"{self.disp(n)} is a symlink to {real}, outside the checkpoint; not opened",
                         "replace the symlink with the file itself (or a hard link)", name=n)
            elif not os.path.exists(p):
                self.hidden.add(n)
                self.add("dir.broken_link", ERROR, self.disp(n), f"{self.disp(n)} is a dangling symlink",
                         "restore its target or remove the link")
            else:
                mode = os.stat(p).st_mode
                if not stat.S_ISREG(mode) and not (stat.S_ISDIR(mode) and not _WEIGHTS_LIKE.search(n)):
                    self.hidden.add(n)
                    self.add("dir.not_a_file", ERROR, self.disp(n),
                             f"{self.disp(n)} links to something that is not a regular file; not opened",
                             "replace it with the file it should be")

    def _kind(self, families: list[L.Family]) -> str:
        kinds = sorted({f.kind for f in families})
        if not kinds:
            return "none"
        if len(kinds) > 1:
            return "mixed"
        if kinds[0] == L.SAFETENSORS:
            return "safetensors-sharded" if any(f.index for f in families) else "safetensors"
        return kinds[0]

    def _variants(self, lay: L.Layout, view: list[str]) -> tuple[list[L.Family], set[str]]:
        """Layout's families plus ``model.<variant>`` safetensors families, which layout lists as
        unrecognised files."""
        groups: dict[str, dict[str, Any]] = {}
        for n in view:
            if L.is_leftover(n):
                continue
            m = _VARIANT_INDEX.match(n)
            if m:
                groups.setdefault(m.group("v"), {"index": None, "single": None, "shards": []})["index"] = n
                continue
            m = _VARIANT_FILE.match(n)
            if m:
                g = groups.setdefault(m.group("v"), {"index": None, "single": None, "shards": []})
                if m.group("i"):
                    g["shards"].append(n)
                else:
                    g["single"] = n
        variant_files = {n for g in groups.values() for n in ([g["index"], g["single"]] + g["shards"]) if n}
        families = [f for f in lay.families if not set(f.all_files) <= variant_files]
        for v, g in sorted(groups.items()):
            shown = self.disp()
            if g["index"]:
                families.append(L.Family(L.SAFETENSORS, list(g["shards"]), index=g["index"]))
                if g["single"]:
                    self.add("layout.index_and_single", ERROR, shown,
                             f"both {g['single']} and {g['index']} are present; loaders disagree on which wins",
                             "keep one with `ckptctl resave --repair --prefer index|single`")
            elif g["shards"]:
                self.add("layout.missing_index", ERROR, shown,
                         f"{len(g['shards'])} model.{v} shards but no model.{v}.safetensors.index.json",
                         "run `ckptctl resave --repair` to rebuild the index from the shard headers")
                families.append(L.Family(L.SAFETENSORS, list(g["shards"])))
            if g["single"]:
                families.append(L.Family(L.SAFETENSORS, [g["single"]]))
        return families, variant_files

    def _layout_findings(self, lay: L.Layout, variant_files: set[str]) -> None:
        for f in lay.findings:
            if f.code == "layout.unrecognised_weights" and os.path.basename(f.path) in variant_files:
                continue
            if f.code == "layout.leftover" or f.code == "layout.shard_missing" or f.code.startswith("index."):
                continue  # re-reported by verify: leftovers as errors, the index in more detail
            self.res.findings.append(f)
        import fnmatch

        leftovers = list(lay.leftovers) + [n for n in self.names if n not in self.hidden
                                           and any(fnmatch.fnmatchcase(n, p) for p in _EXTRA_LEFTOVERS)]
        for n in sorted(set(leftovers)):
            kind = L.is_leftover(n) or "lock"
            self.add("dir.leftover", ERROR, self.disp(n),
                     f"{n} is a leftover of an interrupted write ({kind}); an upload would push it"
                     + (" and loaders that glob *.safetensors would read it" if kind == "temp-shards" else ""),
                     "remove it with `ckptctl gc-tmp` or `ckptctl resave --repair`", kind=kind)

    # weights families --------------------------------------------------------------------------
    def _read_file(self, name: str, container: str) -> _Read:
        """Read one weights file (header or pickle) once; findings are added the first time."""
        if name in self.read:
            return self.read[name]
        path = self.root / name
        out = _Read(None, {})
        self.read[name] = out
        rec = self.record(name, "weights")
        try:
            regular, _ = _regular(path)
            if not regular:
                self.add("dir.not_a_file", ERROR, self.disp(name), f"{self.disp(name)} is not a regular file",
                         "replace it with the weights file")
                return out
            if container == L.SAFETENSORS:
                hdr = read_header(path, display=self.disp(name))
                out.header = hdr
                self.res.findings.extend(hdr.findings)
                self.res.findings.extend(_dtype_notes(hdr))
                self.deep_queue[name] = hdr
                if any(f.code in _UNPARSED for f in hdr.findings):
                    return out
                out.names = set(hdr.tensors) | {f.tensor for f in hdr.findings if f.tensor}
                out.tensors = {t.name: TensorMeta(t.name, t.dtype, t.shape, name) for t in hdr.tensors.values()}
            else:
                from ckptctl.verify_pickle import scan_torch_file

                scan = scan_torch_file(str(path), self.disp(name))
                self.res.findings.extend(scan.findings)
                self.deep_queue[name] = None
                if scan.tensors is not None:
                    out.names = set(scan.tensors)
                    out.tensors = {k: TensorMeta(k, d, s, name) for k, (d, s) in scan.tensors.items()
                                   if k not in scan.aliases}  # a tied alias is not a second weight
        except (OSError, CkptctlError) as exc:
            self.io(name, exc)
        rec.role = "weights"
        return out

    def _weights_family(self, fam: L.Family, container: str) -> dict[str, TensorMeta] | None:
        ext = ".safetensors" if container == L.SAFETENSORS else ".bin"
        if fam.index:
            return self._indexed(fam, container, ext)
        reads = {n: self._read_file(n, container) for n in fam.files}
        table = self._merge(reads)
        if any(r.names is None for r in reads.values()):
            self.partial.add(id(fam))
        if container == L.SAFETENSORS and len(fam.files) == 1:
            hdr = reads[fam.files[0]].header
            if hdr is not None and hdr.metadata:
                self.res.findings.extend(_alias_findings(hdr.metadata, set(hdr.tensors), hdr.path))
        self._shard_sizes(reads)
        return table

    def _merge(self, reads: dict[str, _Read]) -> dict[str, TensorMeta]:
        """All tensors of a family; a name stored in two files is an error."""
        table: dict[str, TensorMeta] = {}
        where: dict[str, list[str]] = {}
        for name, r in reads.items():
            for t in sorted(r.names or ()):
                where.setdefault(t, []).append(name)
            for t, meta in r.tensors.items():
                table.setdefault(t, meta)
        for t, files in sorted(where.items()):
            if len(files) > 1:
                self.add("dir.duplicate_tensor", ERROR, self.disp(),
                         f"tensor {t!r} is stored in {len(files)} files ({', '.join(files)}); which copy a loader "
                         "uses depends on the loader", "run `ckptctl resave --repair` to keep one copy",
                         tensor=t, files=files)
        return table

    def _indexed(self, fam: L.Family, container: str, ext: str) -> dict[str, TensorMeta] | None:
        assert fam.index is not None
        index_name = fam.index
        self.record(index_name, "index")
        idx_display = self.disp(index_name)
        try:
            ok, _ = _regular(self.root / index_name)
            if not ok:
                self.add("dir.not_a_file", ERROR, idx_display, f"{idx_display} is not a regular file",
                         "replace it with the index file")
                return None
            idx = read_index(self.root / index_name, display=idx_display)
        except (OSError, CkptctlError) as exc:
            self.io(index_name, exc)
            return None
        self.res.findings.extend(idx.findings)
        if not idx.weight_map and not any(f.severity == ERROR for f in idx.findings):
            self.add("index.empty", ERROR, idx_display, f"{idx_display}: weight_map is empty", _REPAIR)
        if any(f.code in ("index.bad_json", "index.bad_schema", "index.duplicate_key", "index.too_large")
               for f in idx.findings) or not idx.weight_map:
            reads = {n: self._read_file(n, container) for n in fam.files}
            self.partial.add(id(fam))
            return self._merge(reads)
        reads: dict[str, _Read] = {}
        for shard in idx.shards:
            target = self.resolve(shard, code="index.shard_outside", source=idx_display, what="shard")
            if target is None:
                continue
            if not shard.endswith(ext):
                self.add("index.shard_extension", ERROR, idx_display,
                         f"{idx_display} names shard {shard!r}, which is not a {ext} file; not opened",
                         _REPAIR, name=shard)
                continue
            if not os.path.lexists(target):
                n = sum(1 for s in idx.weight_map.values() if s == shard)
                self.add("index.shard_missing", ERROR, self.disp(shard),
                         f"{shard} is named by {index_name} ({n} tensors) but does not exist",
                         "download or copy the missing shard, or re-export the checkpoint", name=shard, tensors=n)
                continue
            reads[shard] = self._read_file(shard, container)
        listed = set(idx.shards)
        for n in fam.files:
            if n not in listed and n not in reads and _VARIANT_FILE.match(n):
                self.add("layout.unreferenced_shard", ERROR, self.disp(n), f"{n} is not named by {index_name}",
                         "run `ckptctl resave --repair` to remove it")
        table = self._merge(reads)
        if set(idx.shards) - set(reads) or any(r.names is None for r in reads.values()):
            self.partial.add(id(fam))
        self._cross_check(idx_display, idx.weight_map, reads)
        if not any(_bad_name(sh) for sh in idx.shards):
            self._numbering(idx_display, idx.shards, ext)
        if container == L.SAFETENSORS:
            self._totals(idx_display, idx.metadata, reads, idx.shards)
        names = set().union(*(r.names or set() for r in reads.values())) if reads else set()
        self.res.findings.extend(_alias_findings(idx.metadata, names, idx_display))
        self._shard_sizes(reads)
        return table

    def _cross_check(self, idx_display: str, wm: dict[str, str], reads: dict[str, _Read]) -> None:
        located: dict[str, list[str]] = {}
        for shard, r in reads.items():
            for t in r.names or ():
                located.setdefault(t, []).append(shard)
        readable = {s for s, r in reads.items() if r.names is not None}
        for t, shard in sorted(wm.items()):
            if shard not in readable:
                continue  # missing/unreadable shard: reported once, above
            homes = located.get(t, [])
            if shard in homes:
                continue
            if len(homes) == 1:
                self.add("index.wrong_shard", ERROR, idx_display,
                         f"{idx_display} maps {t!r} to {shard}, but it is stored in {homes[0]}", _REPAIR,
                         tensor=t, indexed=shard, actual=homes[0])
            elif not homes:
                self.add("index.tensor_missing", ERROR, self.disp(shard),
                         f"{idx_display} maps {t!r} to {shard}, which does not hold it", _REPAIR + " (if the "
                         "tensor is really gone, re-export the checkpoint)", tensor=t, shard=shard)
        for t, homes in sorted(located.items()):
            if t not in wm:
                self.add("index.tensor_not_indexed", ERROR, self.disp(homes[0]),
                         f"{homes[0]} holds {t!r}, which {os.path.basename(idx_display)} does not list "
                         "(transformers loads it anyway; huggingface_hub does not)", _REPAIR, tensor=t)

    def _numbering(self, idx_display: str, shards: list[str], ext: str) -> None:
        groups: dict[tuple[str, int], set[int]] = {}
        odd: list[str] = []
        for s in shards:
            m = parse_shard_number(s)
            if m and s.endswith(ext):
                groups.setdefault((m[0], m[2]), set()).add(m[1])
            else:
                odd.append(s)
        if odd and len(shards) > 1:
            self.add("index.nonstandard_name", WARNING, idx_display,
                     f"{idx_display} names shards outside the PREFIX-00001-of-0000N pattern ({', '.join(odd[:3])})",
                     "ckptctl resave renames shards to the standard pattern", names=odd[:20])
        if len(groups) > 1:
            self.add("index.shard_numbering", ERROR, idx_display,
                     f"{idx_display} mixes shard families: {', '.join(f'{p}-*-of-{n:05d}' for p, n in sorted(groups))}",
                     _REPAIR, families=[f"{p}-of-{n}" for p, n in sorted(groups)])
            return
        for (prefix, n), got in groups.items():
            missing = sorted(set(range(1, n + 1)) - got)
            beyond = sorted(i for i in got if i < 1 or i > n)
            if missing or beyond or len(got) + len(odd) != n:
                self.add("index.shard_numbering", ERROR, idx_display,
                         f"{idx_display} names {len(got)} shards of {prefix}-*-of-{n:05d}"
                         + (f"; missing numbers {', '.join(map(str, missing[:10]))}" if missing else "")
                         + (f"; numbers beyond {n}: {', '.join(map(str, beyond[:10]))}" if beyond else ""),
                         "the index and the shard set disagree: restore the missing shards or re-export",
                         missing=missing[:100], count=len(got), expected=n)

    def _totals(self, idx_display: str, meta: dict[str, Any], reads: dict[str, _Read], shards: list[str]) -> None:
        complete = set(shards) <= set(reads) and all(
            r.header is not None and r.header.ok for r in reads.values())
        total = meta.get("total_size")
        if "total_size" not in meta:
            if meta or not any(f.code == "index.no_metadata" for f in self.res.findings):
                self.add("index.total_size_missing", WARNING, idx_display, f"{idx_display}: metadata has no total_size",
                         _REPAIR)
        elif not isinstance(total, int) or isinstance(total, bool):
            self.add("index.total_size_mismatch", ERROR, idx_display,
                     f"{idx_display}: total_size is {total!r}, not an integer", _REPAIR)
        elif complete:
            actual = sum(r.header.data_bytes for r in reads.values() if r.header)
            if actual != total:
                self.add("index.total_size_mismatch", ERROR, idx_display,
                         f"{idx_display}: total_size is {total:,} but the shards hold {actual:,} tensor bytes",
                         _REPAIR, stated=total, actual=actual)
        params = meta.get("total_parameters")
        if isinstance(params, int) and not isinstance(params, bool) and complete:
            actual_p = sum(t.numel for r in reads.values() if r.header for t in r.header.tensors.values())
            if actual_p != params:
                self.add("index.total_parameters_mismatch", WARNING, idx_display,
                         f"{idx_display}: total_parameters is {params:,} but the shards hold {actual_p:,} values",
                         "harmless for loading, but the Hub shows the wrong model size; " + _REPAIR,
                         stated=params, actual=actual_p)

    def _shard_sizes(self, reads: dict[str, _Read]) -> None:
        limit = self.opts.max_shard_size
        if not limit:
            return
        for name, r in reads.items():
            if r.header is None or len(r.header.tensors) < 2:
                continue
            if r.header.data_bytes > limit:
                self.add("dir.shard_too_large", WARNING, self.disp(name),
                         f"{name} holds {r.header.data_bytes:,} tensor bytes, over --max-shard-size {limit:,}",
                         "re-shard with `ckptctl resave --max-shard-size`", size=r.header.data_bytes, limit=limit)

    # DCP ---------------------------------------------------------------------------------------
    def _dcp(self, fam: L.Family) -> None:
        from ckptctl.verify_pickle import dcp_requirements, read_dcp_metadata

        for n in fam.files:
            self.record(n, "weights")
            self.deep_queue.setdefault(n, None)
        if not fam.index:
            return
        md_display = self.disp(fam.index)
        self.record(fam.index, "metadata")
        try:
            ok, _ = _regular(self.root / fam.index)
            if not ok:
                self.add("dir.not_a_file", ERROR, md_display, f"{md_display} is not a regular file",
                         "save the checkpoint again")
                return
            md, found = read_dcp_metadata(str(self.root / fam.index), md_display)
        except OSError as exc:
            self.io(fam.index, exc)
            return
        self.res.findings.extend(found)
        if md is None:
            return
        req = dcp_requirements(md, md_display)
        self.res.findings.extend(req.findings)
        self.res.tensors += req.tensors
        for rel, need in sorted(req.referenced.items()):
            size = self.listed_file(
                rel, code_outside="dcp.path_outside", source=md_display, what="storage file",
                code_missing="dcp.file_missing", missing="is referenced by .metadata but does not exist",
                hint_missing="the save did not finish on every rank (or the file was not copied): save it again",
                hint_not_file="save the checkpoint again")
            if size is None:
                continue
            self.record(rel, "weights")
            self.deep_queue.setdefault(rel, None)
            if size is not None and size < need:
                self.add("dcp.file_truncated", ERROR, self.disp(rel),
                         f"{rel} is {size:,} bytes but .metadata needs {need:,}",
                         "the file is truncated: copy it again or save the checkpoint again", size=size, needed=need)
        for n in fam.files:
            if n not in req.referenced:
                self.add("dcp.unreferenced_file", WARNING, self.disp(n),
                         f"{n} is not referenced by .metadata (left over from another save?)",
                         "remove it: it is not part of this checkpoint")

    # config / adapter ---------------------------------------------------------------------------
    def _config(self, tables: list[tuple[L.Family, dict[str, TensorMeta] | None]]) -> None:
        models = [(f, t) for f, t in tables if f.kind in (L.SAFETENSORS, L.PYTORCH)
                  and not (len(f.files) == 1 and _VARIANT_FILE.match(f.files[0]))
                  and not (f.index and _VARIANT_INDEX.match(f.index))]
        if not models:
            return
        if "config.json" not in self.names:
            self.add("config.missing", INFO, self.disp(), f"{self.disp()} has no config.json; config checks skipped",
                     "copy config.json from the source model (transformers needs it)")
            return
        present, cfg = self.open_json("config.json", "config.bad_json")
        if not present:
            return

        def rank(item: tuple[L.Family, Any]) -> int:  # transformers' precedence
            f = item[0]
            if f.kind == L.SAFETENSORS:
                return 0 if f.files == ["model.safetensors"] and not f.index else (1 if f.index else 2)
            return 3 if not f.index else 4

        fam, table = sorted(models, key=rank)[0]
        tok_size, tok_display = None, None
        if "tokenizer.json" in self.names and "tokenizer.json" not in self.hidden:
            ok, doc = self.open_json("tokenizer.json", "config.bad_json")
            if ok:
                tok_size, tok_display = _tokenizer_size(doc), self.disp("tokenizer.json")
        if id(fam) in self.partial or table is None:
            self.add("config.not_checked", INFO, self.disp("config.json"),
                     "config.json is not compared with the tensors: some weights files are missing or unreadable")
        else:
            self.res.findings.extend(check_config(self.disp("config.json"), cfg, table,
                                                  tokenizer_size=tok_size, tokenizer_display=tok_display))
        if not isinstance(cfg, dict):
            return
        tw = cfg.get("transformers_weights")
        if tw is not None:
            target = self.resolve(tw if isinstance(tw, str) else "", code="config.weights_file_outside",
                                  source=self.disp("config.json"), what="transformers_weights")
            if target is not None and not os.path.lexists(target):
                self.add("config.weights_file_missing", ERROR, self.disp("config.json"),
                         f"config.json names transformers_weights {tw!r}, which does not exist",
                         "fix transformers_weights or restore the file", name=tw)
        archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
        if any(isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
               for a in archs):
            if "generation_config.json" not in self.names:
                self.add("config.generation_config_missing", INFO, self.disp(),
                         "no generation_config.json (transformers writes one for generative models)",
                         "copy it from the source model if generation defaults matter")
            if not any(n in self.names for n in _TOKENIZER_FILES):
                self.add("config.tokenizer_missing", INFO, self.disp(),
                         "no tokenizer files; users of the uploaded model will need one",
                         "save the tokenizer into the directory (tokenizer.save_pretrained)")

    def _adapter(self, tables: list[tuple[L.Family, dict[str, TensorMeta] | None]]) -> None:
        peft = [(f, t) for f, t in tables if f.kind == L.PEFT]
        if not peft:
            return
        fam, table = peft[0]
        present, acfg = self.open_json("adapter_config.json", "adapter.bad_config")
        if not present or table is None:
            return
        base_tensors, label = None, None
        base_root = self.base_root
        if base_root is None and isinstance(acfg, dict) and isinstance(acfg.get("base_model_name_or_path"), str):
            base_root = _find_base(acfg["base_model_name_or_path"])
        if base_root is not None:
            base_tensors = _base_tensors(base_root)
            label = f"base model {base_root}"
        if base_tensors is None and isinstance(acfg, dict) and acfg.get("peft_type") == "LORA":
            self.add("adapter.base_unavailable", INFO, self.disp("adapter_config.json"),
                     "the base model is not available locally; shapes and missing keys are not checked against it",
                     "pass --base DIR (or download the base model) for the full check")
        self.res.findings.extend(check_adapter(self.disp("adapter_config.json"), acfg, table,
                                               base=base_tensors, base_label=label))

    # manifest -----------------------------------------------------------------------------------
    def _manifest(self, lay: L.Layout, families: list[L.Family]) -> dict[str, dict[str, Any]] | None:
        if MANIFEST_NAME not in self.names or MANIFEST_NAME in self.hidden:
            return None
        self.record(MANIFEST_NAME, "manifest")
        try:
            ok, _ = _regular(self.root / MANIFEST_NAME)
        except OSError as exc:
            self.io(MANIFEST_NAME, exc)
            return None
        if not ok:
            self.add("dir.not_a_file", ERROR, self.disp(MANIFEST_NAME), "manifest is not a regular file",
                     "re-export with --manifest")
            return None
        doc, found = read_manifest(self.root / MANIFEST_NAME)
        self.res.findings.extend(found)
        if doc is None:
            return None
        shown = self.disp(MANIFEST_NAME)
        listed: dict[str, dict[str, Any]] = {}
        for name, entry in sorted(doc["files"].items()):
            size = self.listed_file(
                name, code_outside="manifest.path_outside", source=shown, what="file",
                code_missing="manifest.file_missing", missing="is listed in the manifest but does not exist",
                hint_missing="restore the file or re-export the checkpoint", hint_not_file="restore the file")
            if size is None:
                continue
            self.record(name, self.records[name].role if name in self.records else "extra")
            if size != entry["size"]:
                self.add("manifest.size_mismatch", ERROR, self.disp(name),
                         f"{name} is {size:,} bytes, the manifest says {entry['size']:,}",
                         "the file changed or is incomplete: copy it again or re-export", name=name,
                         size=size, expected=entry["size"])
                continue
            listed[name] = entry
        weights = {n for f in families for n in f.all_files}
        for n in sorted(weights):
            if n not in doc["files"]:
                self.add("manifest.unlisted_file", ERROR, self.disp(n),
                         f"{n} is a weights file the manifest does not list (added after the export?)",
                         "remove it, or re-export the checkpoint so the manifest covers it", name=n)
        return listed

    # deep ----------------------------------------------------------------------------------------
    def _deep(self, manifest: dict[str, dict[str, Any]] | None) -> None:
        from ckptctl.verify_deep import scan_file

        queue = dict(self.deep_queue)
        for name in manifest or {}:
            queue.setdefault(name, None)
        for name, hdr in queue.items():
            rec = self.records.get(name) or self.record(name, "extra")
            shown = self.disp(name)
            if self.progress:
                self.progress("file", shown, rec.size or 0)
            try:
                dr = scan_file(str(self.root / name), shown, hdr, chunk_bytes=self.opts.chunk_bytes,
                               progress=(lambda n, s=shown: self.progress("bytes", s, n)) if self.progress else None)
            except OSError as exc:
                self.io(name, exc)
                continue
            finally:
                if self.progress:
                    self.progress("done", shown, 0)
            rec.sha256 = dr.sha256
            self.res.bytes_read += dr.bytes_read
            self.res.findings.extend(dr.findings)
            if manifest and name in manifest and manifest[name]["sha256"] != dr.sha256:
                self.add("manifest.hash_mismatch", ERROR, shown,
                         f"{name}: sha256 {dr.sha256[:16]}... differs from the manifest's "
                         f"{str(manifest[name]['sha256'])[:16]}...", "the file is corrupt: copy it again or re-export",
                         name=name, sha256=dr.sha256, expected=manifest[name]["sha256"])


def _find_base(spec: str) -> Path | None:
    """The adapter's base model, if it is available without network: a local directory or a repo
    in the local Hugging Face cache."""
    p = Path(spec)
    if p.is_dir():
        return p
    from ckptctl.resolve import resolve_path

    try:
        r = resolve_path(spec)
    except CkptctlError:
        return None
    return r if r.is_dir() else None


def _base_tensors(root: Path) -> dict[str, TensorMeta] | None:
    """Tensor metadata of a base model's safetensors weights (headers only), or None."""
    try:
        lay = L.scan(root)
    except CkptctlError:
        return None
    fams = [f for f in lay.families if f.kind == L.SAFETENSORS]
    if not fams:
        return None
    fam = sorted(fams, key=lambda f: (f.files != ["model.safetensors"], f.index is None))[0]
    allowed = _allowed_root(root)
    out: dict[str, TensorMeta] = {}
    for name in fam.files:
        p = root / name
        if _bad_name(name) or not _within(os.path.realpath(p), allowed):
            continue
        try:
            if not _regular(p)[0]:
                continue
            hdr = read_header(p, display=str(p))
        except (OSError, CkptctlError):
            continue
        for t in hdr.tensors.values():
            out.setdefault(t.name, TensorMeta(t.name, t.dtype, t.shape, name))
    return out or None
