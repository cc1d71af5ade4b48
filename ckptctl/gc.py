"""``gc-tmp``: find what dead writers left below some roots, prove it dead, and remove it safely.

Two kinds of candidates:

- **ours**: a directory named like a ckptctl staging directory (``staging.NAME_RE``) *with* a
  valid ckptctl owner record. Removed when its writer is dead: the lock is free and, on this host,
  the pid is gone, reused, a zombie or from before the last reboot (``staging.judge_owner``).
  An owner on another host is judged by the lock and ``older_than``. A half-done exchange-less
  publish inside is rolled forward or back (:func:`ckptctl.publish.recover`) before anything goes.
- **foreign**: an entry whose *name* matches an opt-in preset or ``--pattern`` glob. Judged by age
  only (the newest mtime in its tree), since nothing proves its writer dead.

A ``_tmp_*`` directory without a valid owner record is not ours (Orbax #394: never delete by "no
marker"); it is listed as ``unknown`` and kept unless a foreign pattern (``--preset miles``) takes it.
The one exception is an empty *stub* (nothing inside but empty ``lock``/``owner.json``: a writer
killed between ``mkdir`` and its owner record): it holds no data, so it goes once its lock is
free and it is older than ``min_age``.

Safety: the scan never follows a symlink nor descends into a candidate; removal works on
directory file descriptors opened with ``O_NOFOLLOW`` from the root down, so it cannot leave the
root even if a path component is swapped for a symlink meanwhile. A staging directory is removed
under its own lock (a second gc run and the writer cannot race it), owner record last so that an
interrupted removal stays recognisable. NFS ``.nfsXXXX`` files still open elsewhere are retried,
then the candidate is *deferred* to the next run. An error on one entry is recorded and the scan
goes on. Nothing here prints; the CLI renders :class:`GcResult`.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import pwd
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ckptctl import staging
from ckptctl.errors import UsageError

OURS = "ours"
FOREIGN = "foreign"
UNKNOWN = "unknown"

# decisions (final, as rendered)
REMOVED = "removed"
WOULD_REMOVE = "would-remove"
KEPT = "kept"
DEFERRED = "deferred"  # NFS silly-renamed files still open: the next run finishes the job
FAILED = "failed"
VANISHED = "vanished"  # gone before we got to it (another gc run, or its writer finished)

# Opt-in name patterns for what other tools leak. '[?]' is a literal '?' (mcore-bridge temp shards
# are named ...-of-?????.safetensors until the count is known); real shards never match.
PRESETS: dict[str, tuple[str, ...]] = {
    "temp-shards": ("*-of-[?][?][?][?][?].safetensors", "*-of-[?][?][?][?][?].bin"),
    "miles": ("_tmp_*",),
    "orbax": ("*.orbax-checkpoint-tmp*",),
    # Rust tempfile's NamedTempFile::new_in: ".tmp" + 6 alphanumerics; only a regular file
    # beside a .safetensors file counts
    "safetensors-tmp": (".tmp" + "[A-Za-z0-9]" * 6,),
    "incomplete": ("*.incomplete",),  # huggingface_hub partial downloads
    "trainer-tmp": ("tmp-checkpoint-*",),  # transformers Trainer
}
PRESET_HELP = {
    "temp-shards": "*-of-?????.safetensors/.bin (literal '?': temp shards of streaming savers)",
    "miles": "_tmp_* directories without a ckptctl owner record (Miles' staging)",
    "orbax": "*.orbax-checkpoint-tmp* (Orbax's unfinalized checkpoints)",
    "safetensors-tmp": ".tmpXXXXXX files beside a .safetensors file (safetensors' temp files)",
    "incomplete": "*.incomplete (huggingface_hub partial downloads)",
    "trainer-tmp": "tmp-checkpoint-* (transformers Trainer staging)",
}

_NFS_RETRIES = (0.2, 0.4, 0.8)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class GcOptions:
    older_than: float = 3600.0  # foreign entries, and ours whose owner is on another host
    min_age: float = 60.0  # nothing modified more recently than this is ever removed
    max_depth: int = 4  # 1 = only the root's own entries
    presets: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    dry_run: bool = False


@dataclass
class Candidate:
    path: Path
    root: Path
    kind: str  # ours | foreign | unknown
    decision: str
    reason: str
    owner: dict[str, Any] | None = None
    match: str | None = None  # foreign: the preset name or "pattern <glob>"
    age: float = 0.0  # seconds since the newest mtime in its tree
    size: int = 0  # apparent bytes of its regular files (each inode once)
    freed: int = 0  # bytes freed (dry run / kept: the estimate)
    recovery: str | None = None  # rolled-forward | rolled-back (dry run: would-roll-...)
    is_dir: bool = True
    ino: tuple[int, int] = (0, 0)
    mtime: float = 0.0
    error: str | None = None

    @property
    def leaked(self) -> bool:
        return self.decision in (REMOVED, WOULD_REMOVE, DEFERRED, FAILED) and self.kind != UNKNOWN

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "root": str(self.root), "kind": self.kind, "match": self.match,
            "owner": self.owner, "age_seconds": round(self.age, 3), "size": self.size,
            "bytes_freed": self.freed if self.decision == REMOVED else 0,
            "decision": self.decision, "reason": self.reason, "recovery": self.recovery,
            "error": self.error,
        }


@dataclass
class GcProblem:
    path: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


@dataclass
class GcResult:
    roots: list[Path]
    options: GcOptions
    candidates: list[Candidate] = field(default_factory=list)
    problems: list[GcProblem] = field(default_factory=list)
    scanned: int = 0  # directory entries looked at
    seconds: float = 0.0

    @property
    def removed(self) -> list[Candidate]:
        return [c for c in self.candidates if c.decision == REMOVED]

    @property
    def bytes_freed(self) -> int:
        return sum(c.freed for c in self.removed)

    @property
    def bytes_to_free(self) -> int:
        return sum(c.freed for c in self.candidates if c.decision == WOULD_REMOVE)

    @property
    def leaked(self) -> list[Candidate]:
        return [c for c in self.candidates if c.leaked]

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "roots": [str(r) for r in self.roots],
            "dry_run": o.dry_run,
            "options": {"older_than_seconds": o.older_than, "min_age_seconds": o.min_age,
                        "max_depth": o.max_depth, "presets": list(o.presets), "patterns": list(o.patterns)},
            "entries_scanned": self.scanned,
            "seconds": round(self.seconds, 3),
            "candidates": [c.to_dict() for c in self.candidates],
            "removed": len(self.removed),
            "would_remove": sum(1 for c in self.candidates if c.decision == WOULD_REMOVE),
            "kept": sum(1 for c in self.candidates if c.decision == KEPT),
            "deferred": sum(1 for c in self.candidates if c.decision == DEFERRED),
            "leaked": len(self.leaked),
            "bytes_freed": self.bytes_freed,
            "bytes_to_free": self.bytes_to_free,
            "errors": [p.to_dict() for p in self.problems],
        }


Progress = Callable[[str], None]


# ------------------------------------------------------------------------------------------
# validation


def check_pattern(glob: str) -> str:
    """A --pattern must name something: no '/', at least one literal character."""
    if not glob or "/" in glob:
        raise UsageError(f"invalid --pattern {glob!r}: it is matched against one entry's name, without '/'",
                         "pass a name glob such as '*.partial'")
    if not any(ch not in "*?[]!" for ch in glob):
        raise UsageError(f"refusing --pattern {glob!r}: it matches every name",
                         "give the glob some literal text, such as '*.partial'")
    return glob


def check_preset(name: str) -> str:
    if name not in PRESETS:
        raise UsageError(f"unknown --preset {name!r}", f"choose from {', '.join(PRESETS)}")
    return name


def _homes() -> set[str]:
    homes = set()
    for h in (os.environ.get("HOME"), os.path.expanduser("~")):
        if h:
            homes.add(os.path.realpath(h))
    try:
        homes.add(os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir))
    except (KeyError, OSError):
        pass
    return homes


def check_root(root: str | os.PathLike[str]) -> Path:
    """The resolved root; refuses '/', the home directory, a missing path and a non-directory."""
    given = os.fspath(root)
    real = os.path.realpath(given)
    if real == os.sep:
        raise UsageError(f"refusing to clean up the filesystem root ({given})",
                         "pass the directory that holds your checkpoints, e.g. /data/checkpoints")
    if real in _homes():
        raise UsageError(f"refusing to clean up the home directory ({given})",
                         "pass the directory below it that holds your checkpoints")
    try:
        st = os.stat(real)
    except OSError as exc:
        raise UsageError(f"cannot use root {given}: {exc.strerror}", "check the path") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"root {given} is not a directory", "pass the directory that holds your checkpoints")
    return Path(real)


# ------------------------------------------------------------------------------------------
# matching


class _Matcher:
    """Name -> the preset or pattern it matches (first wins), or None."""

    def __init__(self, opts: GcOptions) -> None:
        import re

        self.rules = [(name, re.compile("|".join(fnmatch.translate(p) for p in PRESETS[name])))
                      for name in opts.presets]
        self.rules += [(f"pattern {g}", re.compile(fnmatch.translate(g))) for g in opts.patterns]

    def __call__(self, name: str, is_file: bool, beside_shard: bool) -> str | None:
        for label, rx in self.rules:
            if rx.match(name):
                if label == "safetensors-tmp" and not (is_file and beside_shard):
                    continue
                return label
        return None


# ------------------------------------------------------------------------------------------
# measuring a tree (lstat only, never following a link)


@dataclass
class _Measure:
    size: int = 0
    freeable: int = 0
    newest: float = 0.0
    error: str | None = None
    nested_staging: list[str] = field(default_factory=list)  # ckptctl staging dirs inside


def _measure(path: Path) -> _Measure:
    m = _Measure()
    links: dict[tuple[int, int], list[int]] = {}  # inode -> [seen, nlink, size]

    def visit(p: str, st: os.stat_result) -> None:
        m.newest = max(m.newest, st.st_mtime)
        if stat.S_ISREG(st.st_mode):
            key = (st.st_dev, st.st_ino)
            rec = links.setdefault(key, [0, st.st_nlink, st.st_size])
            rec[0] += 1

    try:
        top = os.lstat(path)
    except OSError as exc:
        m.error = exc.strerror
        return m
    visit(str(path), top)
    if stat.S_ISDIR(top.st_mode):
        stack = [str(path)]
        while stack:
            d = stack.pop()
            try:
                with os.scandir(d) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        visit(e.path, st)
                        if stat.S_ISDIR(st.st_mode):
                            stack.append(e.path)
                            if staging.NAME_RE.match(e.name):
                                m.nested_staging.append(e.path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    m.error = f"cannot read {d}: {exc.strerror}"
    for seen, nlink, size in links.values():
        m.size += size
        if seen >= nlink:
            m.freeable += size  # every link is inside: removing the tree frees it
    return m


# ------------------------------------------------------------------------------------------
# liveness


def judge(path: Path, owner: dict[str, Any]) -> staging.Liveness:
    """Liveness of a staging directory's writer (lock, then pid/start time/boot id/zombie)."""
    return staging.judge_owner(path, owner)


def _same_host(owner: dict[str, Any]) -> bool:
    return owner.get("host") == socket.gethostname()


def _pending_recovery(path: Path) -> str | None:
    """What ``publish.recover`` would do to this staging directory (dry run), or None."""
    parsed = staging.parse_name(path.name)
    if parsed is None or not os.path.lexists(path / staging.OLD):
        return None
    if os.path.lexists(path.parent / parsed[0]):
        return None
    if (path / staging.READY).exists() and (path / staging.DATA).is_dir():
        return "roll-forward"
    return "roll-back"


def _lock_held_any(path: Path) -> bool:
    """A foreign directory that happens to hold a held ``lock`` file is somebody's live work."""
    try:
        return staging.lock_is_held(path)
    except OSError:
        return False


def format_age(seconds: float) -> str:
    """45s, 12m, 3h05m, 2d04h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


# ------------------------------------------------------------------------------------------
# scan


def _judge_ours(c: Candidate, opts: GcOptions, now: float) -> None:
    owner = c.owner or {}
    try:
        live = judge(c.path, owner)
    except OSError as exc:
        c.decision, c.reason = KEPT, f"cannot probe its lock: {exc.strerror}"
        c.error = f"cannot probe the staging lock: {exc.strerror}"
        return
    if live.alive:
        c.decision, c.reason = KEPT, f"writer alive: {live.reason}"
        return
    if not _same_host(owner):
        if c.age < max(opts.older_than, opts.min_age):
            c.decision = KEPT
            c.reason = (f"owner on host {owner.get('host')!r}, lock free, but modified {format_age(c.age)} ago "
                        f"(< --older-than {format_age(opts.older_than)})")
            return
        reason = f"owner on host {owner.get('host')!r}: lock free and idle for {format_age(c.age)}"
    else:
        if c.age < opts.min_age:
            c.decision = KEPT
            c.reason = f"writer dead ({live.reason}) but modified {format_age(c.age)} ago (< --min-age)"
            return
        reason = f"writer dead: {live.reason}"
    c.recovery = _pending_recovery(c.path)
    if c.recovery:
        reason += f"; half-done publish: will {c.recovery} {c.path.parent / staging.parse_name(c.path.name)[0]}"
    c.decision, c.reason = WOULD_REMOVE, reason


def _is_stub(path: Path) -> bool:
    """An empty staging stub: a writer killed between mkdir and writing its owner record, or a
    gc run interrupted at its last step. It holds nothing but empty ``lock``/``owner.json``."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
        for e in entries:
            if e.name not in (staging.LOCK, staging.OWNER):
                return False
            st = e.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_size:
                return False
    except OSError:
        return False
    return True


def _judge_stub(c: Candidate, opts: GcOptions) -> None:
    if _lock_held_any(c.path):
        c.decision, c.reason = KEPT, "writer alive: lock held (owner record not written yet)"
    elif c.age < opts.min_age:
        c.decision = KEPT
        c.reason = f"empty staging stub modified {format_age(c.age)} ago (< --min-age): its writer may be starting"
    else:
        c.decision = WOULD_REMOVE
        c.reason = "empty staging stub (no owner record, no data), lock free"


def _live_inside(c: Candidate, nested: list[str]) -> str | None:
    """Why a foreign directory must stay although it is old: it holds a lock someone holds, or a
    ckptctl staging directory whose writer is alive (a paused writer is still a writer)."""
    if not c.is_dir:
        return None
    if _lock_held_any(c.path):
        return f"foreign ({c.match}): a process holds its lock file"
    for d in nested:
        p = Path(d)
        owner = staging.read_owner(p)
        try:
            alive = judge(p, owner).alive if owner else _lock_held_any(p)
        except OSError:
            alive = True
        if alive:
            return f"foreign ({c.match}): holds the staging directory of a live ckptctl writer ({p.name})"
    return None


def _judge_foreign(c: Candidate, opts: GcOptions, nested: list[str]) -> None:
    threshold = max(opts.older_than, opts.min_age)
    why = _live_inside(c, nested)
    if why:
        c.decision, c.reason = KEPT, why
        return
    if c.age < threshold:
        c.decision = KEPT
        c.reason = f"foreign ({c.match}), judged by age only: modified {format_age(c.age)} ago (< {format_age(threshold)})"
    else:
        c.decision = WOULD_REMOVE
        c.reason = f"foreign ({c.match}), judged by age only: idle for {format_age(c.age)} (>= {format_age(threshold)})"


def _candidate(path: Path, root: Path, kind: str, st: os.stat_result, now: float,
               **kw: Any) -> tuple[Candidate, _Measure]:
    m = _measure(path)  # an unreadable part only makes the size a lower bound
    c = Candidate(path=path, root=root, kind=kind, decision=KEPT, reason="", is_dir=stat.S_ISDIR(st.st_mode),
                  ino=(st.st_dev, st.st_ino), mtime=st.st_mtime, size=m.size, freed=m.freeable,
                  age=max(0.0, now - (m.newest or st.st_mtime)), **kw)
    return c, m


def scan(roots: Iterable[Path], opts: GcOptions, result: GcResult | None = None) -> GcResult:
    """Walk the roots and judge every candidate (decisions: would-remove or kept). Changes nothing."""
    roots = list(roots)
    res = result or GcResult(roots=roots, options=opts)
    now = time.time()
    seen_dirs: set[tuple[int, int]] = set()
    seen_cands: set[tuple[int, int]] = set()
    match = _Matcher(opts)
    for root in roots:
        try:
            st_root = os.stat(root)
        except OSError as exc:
            res.problems.append(GcProblem(str(root), f"cannot read the root: {exc.strerror}"))
            continue
        if (st_root.st_dev, st_root.st_ino) in seen_dirs:
            continue
        seen_dirs.add((st_root.st_dev, st_root.st_ino))
        stack: list[tuple[Path, int, int]] = [(root, 0, st_root.st_dev)]
        while stack:
            d, depth, dev = stack.pop()
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue
            except OSError as exc:
                res.problems.append(GcProblem(str(d), f"cannot list: {exc.strerror}"))
                continue
            res.scanned += len(entries)
            beside_shard = any(e.name.endswith(".safetensors") for e in entries)
            for e in entries:
                # d_type answers is_dir/is_file without a syscall; only candidates are stat'ed
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                    staging_like = is_dir and staging.NAME_RE.match(e.name) is not None
                    foreign = match(e.name, e.is_file(follow_symlinks=False), beside_shard)
                    if not (staging_like or foreign):
                        if is_dir and depth + 1 < opts.max_depth:
                            key = (dev, e.inode())
                            if key not in seen_dirs:
                                seen_dirs.add(key)
                                stack.append((Path(e.path), depth + 1, dev))
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    res.problems.append(GcProblem(e.path, f"cannot stat: {exc.strerror}"))
                    continue
                path = Path(e.path)
                cand = None
                if staging_like:
                    cand = _staging_candidate(path, root, st, opts, now, foreign)
                if cand is None and foreign:
                    cand, m = _candidate(path, root, FOREIGN, st, now, match=foreign)
                    _judge_foreign(cand, opts, m.nested_staging)
                if cand is not None:  # never descend into a candidate
                    key = (st.st_dev, st.st_ino)
                    if key not in seen_cands:
                        seen_cands.add(key)
                        res.candidates.append(cand)
                        if cand.error:
                            res.problems.append(GcProblem(str(cand.path), cand.error))
    res.candidates.sort(key=lambda c: str(c.path))
    return res


def _staging_candidate(path: Path, root: Path, st: os.stat_result, opts: GcOptions, now: float,
                       foreign: str | None) -> Candidate | None:
    owner = staging.read_owner(path)
    if owner is not None:
        c, _ = _candidate(path, root, OURS, st, now, owner=owner)
        _judge_ours(c, opts, now)
        return c
    if _is_stub(path):
        c, _ = _candidate(path, root, OURS, st, now)
        _judge_stub(c, opts)
        return c
    if foreign:
        return None  # the foreign path takes it, by age (it is not provably ours)
    c, _ = _candidate(path, root, UNKNOWN, st, now)
    c.decision = KEPT
    c.reason = ("named like ckptctl staging but has no ckptctl owner record: not provably ours "
                "(--preset miles removes such directories by age)")
    return c


# ------------------------------------------------------------------------------------------
# removal


class _Deferred(Exception):
    pass


def _open_parent(c: Candidate) -> int:
    """An fd of the candidate's parent, reached from the root one component at a time with
    O_NOFOLLOW: a symlink swapped in after the scan makes this fail instead of leaving the root."""
    rel = c.path.relative_to(c.root).parts
    fd = os.open(c.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rel[:-1]:
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rm_entries(dfd: int, where: str, skip: tuple[str, ...] = ()) -> int:
    """Remove everything inside the directory ``dfd`` (``where``, for messages) except ``skip``."""
    freed = 0
    with os.scandir(dfd) as it:
        names = [e.name for e in it]
    for name in names:
        if name in skip:
            continue
        try:
            freed += _rm_at(dfd, name, where=f"{where}/{name}")
        except OSError as exc:
            # NFS refuses to unlink a silly-renamed file that is still open: retried by the caller
            if not (name.startswith(".nfs") and exc.errno in (errno.EBUSY, errno.ENOTEMPTY)):
                raise
    return freed


def _rm_at(parent_fd: int, name: str, *, where: str, keep_last: tuple[str, ...] = ()) -> int:
    """Remove ``name`` under ``parent_fd`` without following links; bytes actually freed.

    ``keep_last`` names inside the directory are removed after everything else, in that order.
    ENOENT anywhere is someone else having removed it first (an overlapping gc run): fine.
    Errors carry ``where`` (the full path) as their filename.
    """
    try:
        return _rm_at_inner(parent_fd, name, where, keep_last)
    except OSError as exc:
        if exc.filename == name:
            exc.filename = where
        raise


def _rm_at_inner(parent_fd: int, name: str, where: str, keep_last: tuple[str, ...]) -> int:
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return 0
        # the last link of a regular file frees its blocks
        return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0
    try:
        dfd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return 0
    freed = 0
    try:
        fst = os.fstat(dfd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise OSError(errno.ESTALE, "changed while being removed", name)
        for attempt in range(len(_NFS_RETRIES) + 1):
            freed += _rm_entries(dfd, where, skip=keep_last)
            for last in keep_last:
                freed += _rm_at(dfd, last, where=f"{where}/{last}")
            try:
                os.rmdir(name, dir_fd=parent_fd)
                return freed
            except FileNotFoundError:
                return freed
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EBUSY):
                    raise
                # NFS: open files were silly-renamed to .nfsXXXX; they go when closed elsewhere.
                if attempt < len(_NFS_RETRIES):
                    time.sleep(_NFS_RETRIES[attempt])
                    continue
                with os.scandir(dfd) as it:
                    left = [e.name for e in it]
                if left and all(n.startswith(".nfs") for n in left):
                    raise _Deferred(f"NFS files still open elsewhere ({', '.join(sorted(left)[:3])}); "
                                    "the next run finishes the job") from None
                raise
    finally:
        os.close(dfd)
    return freed


def _lock_staging(parent_fd: int, name: str) -> tuple[int, int] | None:
    """(staging dir fd, lock fd) with our flock on ``<staging>/lock``; None when it is held."""
    sfd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        try:
            lfd = os.open(staging.LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=sfd)
        except PermissionError:
            lfd = os.open(staging.LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lfd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(sfd)
                return None
            raise
        # the lock file we locked must still be the one in the directory (not one a gc run
        # that finished meanwhile unlinked)
        a, b = os.fstat(lfd), os.stat(staging.LOCK, dir_fd=sfd, follow_symlinks=False)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(lfd)
            raise FileNotFoundError(errno.ENOENT, "lock file replaced", staging.LOCK)
        return sfd, lfd
    except BaseException:
        os.close(sfd)
        raise


def _lock_or_decide(c: Candidate, parent_fd: int, held: str) -> tuple[int, int] | None:
    """Take the candidate's staging lock; when that is not possible, record why and return None."""
    try:
        fds = _lock_staging(parent_fd, c.path.name)
    except FileNotFoundError:
        c.decision, c.reason = VANISHED, "removed meanwhile (another gc run?)"
        return None
    if fds is None:
        c.decision, c.reason = KEPT, f"its lock is held now ({held})"
    return fds


def _remove_stub(c: Candidate, parent_fd: int) -> None:
    fds = _lock_or_decide(c, parent_fd, "a writer starting, or another gc run")
    if fds is None:
        return
    sfd, lfd = fds
    try:
        if not _is_stub(c.path):
            c.decision, c.reason = KEPT, "no longer an empty stub (a writer is using it)"
            return
        c.freed = _rm_at(parent_fd, c.path.name, where=str(c.path), keep_last=(staging.LOCK,))
        c.decision = REMOVED
    finally:
        os.close(lfd)
        os.close(sfd)


def _remove_ours(c: Candidate, parent_fd: int) -> None:
    if c.owner is None:
        _remove_stub(c, parent_fd)
        return
    name = c.path.name
    # 1. fresh liveness verdict (a gc run may have overlapped, time has passed since the scan)
    owner = staging.read_owner(c.path)
    if owner is None:
        c.decision, c.reason = VANISHED, "owner record gone (removed by another gc run?)"
        return
    if owner != c.owner:
        c.decision, c.reason = KEPT, "owner record changed since the scan"
        return
    live = judge(c.path, owner)
    if live.alive:
        c.decision, c.reason = KEPT, f"writer alive: {live.reason}"
        return
    # 2. take the staging lock ourselves: a second gc run (or anyone) now backs off
    fds = _lock_or_decide(c, parent_fd, "another gc run, or a writer")
    if fds is None:
        return
    sfd, lfd = fds
    try:
        if staging.read_owner(c.path) != owner:
            c.decision, c.reason = VANISHED, "owner record gone (removed by another gc run?)"
            return
        # 3. a half-done exchange-less publish: restore the checkpoint first
        from ckptctl.publish import recover

        c.recovery = recover(c.path)
        parsed = staging.parse_name(name)
        if parsed and os.path.lexists(c.path / staging.OLD) and not os.path.lexists(c.path.parent / parsed[0]):
            raise OSError(errno.EEXIST, "old/ holds the only copy of the checkpoint; not removing", str(c.path))
        # 4. remove: data first (an interrupted removal stays recognisable by its owner record),
        # then the owner record, the lock last (a racing gc run finds no owner and backs off)
        c.freed = _rm_at(parent_fd, name, where=str(c.path), keep_last=(staging.OWNER, staging.LOCK))
        c.decision = REMOVED
    finally:
        os.close(lfd)
        os.close(sfd)


def _remove_foreign(c: Candidate, parent_fd: int) -> None:
    name = c.path.name
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        c.decision, c.reason = VANISHED, "removed meanwhile"
        return
    if (st.st_dev, st.st_ino) != c.ino or st.st_mtime > c.mtime:
        c.decision, c.reason = KEPT, "changed since the scan"
        return
    why = _live_inside(c, _measure(c.path).nested_staging if c.is_dir else [])
    if why:
        c.decision, c.reason = KEPT, why
        return
    c.freed = _rm_at(parent_fd, name, where=str(c.path))
    c.decision = REMOVED


def remove(res: GcResult, progress: Progress | None = None) -> GcResult:
    """Remove every would-remove candidate (re-checking each right before); errors are recorded."""
    for c in res.candidates:
        if c.decision != WOULD_REMOVE:
            continue
        try:
            parent_fd = _open_parent(c)
        except FileNotFoundError:
            c.decision, c.reason = VANISHED, "removed meanwhile"
            continue
        except OSError as exc:
            _fail(res, c, f"cannot open its parent without following links: {exc.strerror}")
            continue
        try:
            if c.kind == OURS:
                _remove_ours(c, parent_fd)
            else:
                _remove_foreign(c, parent_fd)
        except _Deferred as exc:
            c.decision, c.reason = DEFERRED, str(exc)
        except OSError as exc:
            what = exc.filename if exc.filename and str(exc.filename) != str(c.path) else None
            _fail(res, c, f"cannot remove {what}: {exc.strerror or exc}" if what else f"{exc.strerror or exc}")
        finally:
            os.close(parent_fd)
        if progress and c.decision in (REMOVED, DEFERRED, FAILED):
            progress(f"{c.decision} {c.path}" + (f" ({c.recovery})" if c.recovery else ""))
    return res


def _fail(res: GcResult, c: Candidate, message: str) -> None:
    c.decision, c.error = FAILED, message
    c.reason = f"{c.reason}; removal failed: {message}" if c.reason else message
    res.problems.append(GcProblem(str(c.path), message))


def run(roots: Iterable[str | os.PathLike[str]], opts: GcOptions | None = None,
        progress: Progress | None = None) -> GcResult:
    """Validate the roots, scan, and (unless ``opts.dry_run``) remove. Raises UsageError for bad
    roots or options; every other problem is recorded in the result."""
    opts = opts or GcOptions()
    if opts.max_depth < 1:
        raise UsageError(f"--max-depth must be at least 1 (got {opts.max_depth})", "use --max-depth 1 or more")
    if opts.older_than < 0 or opts.min_age < 0:
        raise UsageError("--older-than and --min-age must not be negative", "use e.g. --older-than 1h")
    for p in opts.presets:
        check_preset(p)
    for g in opts.patterns:
        check_pattern(g)
    checked: list[Path] = []
    for r in roots:
        p = check_root(r)
        if p not in checked:
            checked.append(p)
    if not checked:
        raise UsageError("no root given", "pass the directory that holds your checkpoints")
    started = time.monotonic()
    res = scan(checked, opts)
    if not opts.dry_run:
        remove(res, progress)
    res.seconds = time.monotonic() - started
    return res
