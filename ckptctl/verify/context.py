"""The check context: what every verify step reads and where it reports.

One :class:`Context` per checkpoint path: its root, the layout ``layout.scan`` made of it, the
findings sink and file records of the :class:`~ckptctl.verify.report.PathResult`, the entries
screening took out of view, and the read cache (each weights file is read once, whichever step
asks first). The context also owns the one way a step opens a name: names taken from a JSON
document go through :func:`ckptctl.format.names.member_problem` and the symlink check of
:meth:`Context.inside`, and every file is checked to be a regular file before it is opened.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR, Finding
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.format.header import Header
from ckptctl.format.tensor import TensorSpec
from ckptctl.layout import Family, Layout
from ckptctl.layout.reading import MetadataReading
from ckptctl.verify.report import IO_CODE, FileRecord, PathResult

# (event, path, amount): "path" (a checkpoint starts), "file" (amount = bytes to read), "bytes", "done".
ProgressFn = Callable[[str, str, int], None]
MAX_JSON_BYTES = 64 * 1024 * 1024
DEEP_NOT_ASKED = "not asked: --deep"  # why the deep check did not run
STATIC_ASKED = "--static: static rules only"  # why the model-class check did not run


@dataclass
class VerifyOptions:
    """What verify is asked to do beyond its default checks (``--deep``, ``--base``, ``--max-shard-
    size``), and ``--static``: no model-class check (no library, no torch imported for it).
    ``reading``: the metadata reading of the command verify runs in (a repair's verify of what it
    read, or staged: every header it decoded is not decoded again); None: verify's own."""

    deep: bool = False
    static: bool = False
    base: str | None = None  # base model for adapter checks (path or cached repo id)
    max_shard_size: int | None = None
    chunk_bytes: int = 8 * 1024 * 1024
    reading: MetadataReading | None = field(default=None, compare=False, repr=False)


@dataclass
class WeightsRead:
    """One weights file as read: the tensor names it holds (None when unreadable), the specs of
    its weights (a tied pickle alias is not a second weight) and, for safetensors, its header."""

    names: set[str] | None
    tensors: dict[str, TensorSpec]
    header: Header | None = None


@dataclass
class FamilyTensors:
    """A weights family with the tensors of the files that could be read. ``complete`` is False
    when a file of the family is missing or unreadable (config rules then do not run).
    ``facts``: where the family's index names exactly these tensors, what the reading's names
    work drew from the index's names (:meth:`ckptctl.format.index.Index.name_facts`, asked only
    when the config rules run)."""

    family: Family
    tensors: dict[str, TensorSpec]
    complete: bool
    facts: Callable[[], dict[str, Any] | None] | None = None


def within(real: str, base: str) -> bool:
    try:
        return os.path.commonpath([real, base]) == base
    except ValueError:
        return False


def allowed_root(root: Path) -> str:
    """The directory symlinks may resolve into: the checkpoint itself, or for a Hugging Face cache
    snapshot (``models--x/snapshots/<rev>``, files linked to ``../../blobs``) the repo's cache folder."""
    real = os.path.realpath(root)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and os.path.isdir(os.path.join(os.path.dirname(parent), "blobs")):
        return os.path.dirname(parent)
    return real


class Context:
    def __init__(self, root: Path, result: PathResult, options: VerifyOptions, progress: ProgressFn | None = None,
                 base_root: Path | None = None, reading: MetadataReading | None = None) -> None:
        self.root = root
        # what this verify reads of the checkpoint's metadata (shared with component contexts)
        self.reading = (reading if reading is not None else options.reading if options.reading is not None
                        else MetadataReading())
        self.prefix = ""  # a component's folder below the checkpoint root, with a trailing "/"
        self.needs_weights = True  # a directory without weights is an error (not so a scheduler's folder)
        self.result = result
        self.options = options
        self.progress = progress
        self.base_root = base_root
        self.allowed = allowed_root(root)
        self.names: list[str] = []  # the directory's entries
        self.hidden: set[str] = set()  # entries screening took out of view (reported there)
        # entries screening kept in view: inside the checkpoint (a link's target was checked)
        self.vetted: set[str] = set()
        self.stats: dict[str, os.stat_result] = {}  # screening's lstat of each regular file (no link)
        self.layout: Layout | None = None
        self.reads: dict[str, WeightsRead] = {}
        self.tables: list[FamilyTensors] = []
        self.deep_queue: dict[str, Header | None] = {}  # files --deep reads, with the header to decode by
        self.manifest: dict[str, dict[str, Any]] | None = None  # manifest entries whose size matched
        self.records: dict[str, FileRecord] = {}  # by name relative to the checkpoint root
        self.stopped = False  # set by a step after which no other step can run
        # check group -> None (it ran) or why it did not; shared with component contexts
        self.checks: dict[str, str | None] = {}
        # (library, class) a multi-component root's manifest names for this component folder
        self.declared_class: tuple[str | None, str | None] | None = None
        self.class_checked = False  # the model-class check judged config.json against the weights
        self.parsed: dict[str, tuple[bool, Any]] = {}  # open_json's result per name (reported once)

    def component(self, path: str) -> "Context":
        """The context of a component folder (diffusers pipeline, sentence-transformers module):
        its own view and layout, the same result, file records and allowed link targets."""
        sub = Context(self.root / path, self.result, self.options, self.progress, self.base_root, self.reading)
        sub.prefix = f"{self.prefix}{path}/"
        sub.allowed = self.allowed
        sub.records = self.records
        sub.checks = self.checks
        return sub

    def mark(self, group: str, skipped: str | None) -> None:
        """Record that check ``group`` ran (``skipped`` None) or why it did not. A group that ran
        anywhere (the root or a component) ran; the first reason given for a skip is kept."""
        if skipped is None:
            self.checks[group] = None
        else:
            self.checks.setdefault(group, skipped)

    # reporting ---------------------------------------------------------------------------------
    def disp(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def add(self, code: str, severity: str, path: str, message: str, hint: str | None = None,
            tensor: str | None = None, **details: Any) -> None:
        self.result.findings.append(Finding(code, severity, path, message, hint, tensor, dict(details)))

    def extend(self, findings: list[Finding]) -> None:
        self.result.findings.extend(findings)

    def io(self, name: str, exc: OSError | CkptctlError) -> None:
        if isinstance(exc, CkptctlError):
            msg, hint = exc.message, exc.hint
        else:
            msg = f"cannot read {self.disp(name)}: {exc.strerror or exc}"
            hint = "check the file, its permissions and the storage"
        self.add(IO_CODE, ERROR, self.disp(name), msg, hint)

    def stop(self, name: str, exc: OSError | CkptctlError) -> None:
        self.io(name, exc)
        self.stopped = True

    def stat(self, name: str) -> os.stat_result:
        """``os.stat`` of ``root / name``, taken once: a regular file's comes from screening."""
        st = self.stats.get(name)
        return st if st is not None else os.stat(self.root / name)

    def record(self, name: str, role: str) -> FileRecord:
        """The file record of ``name`` (created on first use, named from the checkpoint root)."""
        rec = self.records.get(self.prefix + name)
        if rec is None:
            size = None
            try:
                size = self.stat(name).st_size
            except OSError:
                pass
            rec = self.records[self.prefix + name] = FileRecord(self.prefix + name, role, size)
            self.result.files.append(rec)
        return rec

    def escaped(self, name: str, how: str) -> None:
        """``name`` leads outside the checkpoint (``how``): reported, and never opened."""
        self.hidden.add(name)
        self.add("dir.symlink_escape", ERROR, self.disp(name), f"{self.disp(name)} {how}, outside the checkpoint; "
                 "not opened", "replace the symlink with the file itself (or a hard link)", name=name)

    def not_a_file(self, name: str, what: str, hint: str) -> None:
        """``name`` is not a regular file (``what`` it is instead): reported, and never opened."""
        self.add("dir.not_a_file", ERROR, self.disp(name), f"{self.disp(name)} {what}", hint)

    # opening names -----------------------------------------------------------------------------
    def inside(self, name: str) -> Path | None:
        """``root / name`` unless it was screened out or resolves outside the checkpoint through a
        symlink (reported here, never opened). The path may not exist."""
        if name in self.vetted:
            return self.root / name  # an entry of the directory screening kept in view
        if name.split("/")[0] in self.hidden:
            return None  # already reported as an escaping or broken symlink, or not a file
        target = self.root / name
        if os.path.lexists(target) and not within(os.path.realpath(target), self.allowed):
            self.escaped(name, f"resolves to {os.path.realpath(target)}")
            return None
        return target

    def resolve(self, name: Any, *, code: str, source: str, what: str) -> Path | None:
        """A file name read from a JSON document: refused (``code``) when it is not a relative name
        inside the checkpoint, then :meth:`inside`."""
        why = N.member_problem(name)
        if why:
            self.add(code, ERROR, source, f"{source}: {what} {name!r} is refused: {why}",
                     "file names must be relative paths inside the checkpoint directory; fix or rebuild the file",
                     name=name)
            return None
        return self.inside(name)

    def regular_size(self, name: str, hint: str) -> int | None:
        """The size of a regular file, or None after reporting that it is not one (a directory,
        FIFO or device is never opened) or cannot be stat'ed."""
        try:
            st = self.stat(name)
        except OSError as exc:
            self.io(name, exc)
            return None
        if not stat.S_ISREG(st.st_mode):
            self.not_a_file(name, "is not a regular file", hint)
            return None
        return st.st_size

    def listed_file(self, name: Any, *, code_outside: str, source: str, what: str, code_missing: str,
                    missing: str, hint_missing: str, hint_not_file: str) -> int | None:
        """Size of a file that a document (DCP metadata, manifest) lists, or None after reporting
        why it cannot be used: outside the directory, missing, unreadable or not a regular file."""
        target = self.resolve(name, code=code_outside, source=source, what=what)
        if target is None:
            return None
        if not os.path.lexists(target):
            self.add(code_missing, ERROR, self.disp(name), f"{name} {missing}", hint_missing, name=name)
            return None
        return self.regular_size(name, hint_not_file)

    def open_json(self, name: str, role: str, code_bad: str) -> tuple[bool, Any]:
        """Parse a JSON file of the directory: (True, document), or (False, None) when it is absent,
        screened out, or unreadable (reported)."""
        if name not in self.names or name in self.hidden:
            return False, None
        if name in self.parsed:
            return self.parsed[name]
        self.parsed[name] = result = self._parse_json(name, role, code_bad)
        return result

    def _parse_json(self, name: str, role: str, code_bad: str) -> tuple[bool, Any]:
        self.record(name, role)
        if self.regular_size(name, "replace it with the file") is None:
            return False, None
        try:
            raw = small.read_small(self.root / name, limit=MAX_JSON_BYTES, follow=True)
        except OSError as exc:
            self.io(name, exc)
            return False, None
        try:
            return True, small.loads(raw.decode("utf-8"))
        except ValueError as exc:  # bad UTF-8, bad JSON, nested too deeply
            self.add(code_bad, ERROR, self.disp(name), f"{self.disp(name)} is not valid JSON ({type(exc).__name__})",
                     "fix the file (or copy it again from the source model)")
            return False, None
