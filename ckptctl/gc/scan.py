"""gc-tmp's scan: validate the roots and options, walk the roots (never following a link, never
descending into a candidate), measure each candidate and have it judged. Changes nothing."""

from __future__ import annotations

import fnmatch
import os
import pwd
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ckptctl import staging
from ckptctl.errors import UsageError
from ckptctl.format import names as N
from ckptctl.format.names import PRESETS, parse_staging_name
from ckptctl.gc.judge import judge_foreign, judge_staging
from ckptctl.gc.model import Candidate, Decision, GcOptions, GcProblem, GcResult, Kind
from ckptctl.staging import State

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
    """An entry -> the preset (``format.names.LEFTOVERS``: name, file or dir) or ``--pattern``
    glob (any entry) it matches, first wins; or None."""

    def __init__(self, opts: GcOptions) -> None:
        self.presets = [PRESETS[name] for name in opts.presets]
        self.patterns = list(opts.patterns)

    def __call__(self, name: str, *, is_dir: bool, beside_safetensors: bool) -> str | None:
        for lo in self.presets:
            if lo.matches(name, is_dir=is_dir, beside_safetensors=beside_safetensors):
                return lo.preset
        for glob in self.patterns:
            if fnmatch.fnmatchcase(name, glob):
                return f"pattern {glob}"
        return None


# ------------------------------------------------------------------------------------------
# measuring a tree (lstat only, never following a link)


@dataclass
class Measure:
    size: int = 0  # apparent bytes of regular files, each inode once
    freeable: int = 0  # of which every link is inside the tree
    newest: float = 0.0  # newest mtime in the tree
    nested_staging: list[str] = field(default_factory=list)  # ckptctl staging dirs inside


def measure(path: Path) -> Measure:
    """Sizes and newest mtime of a tree; an unreadable part only makes them lower bounds."""
    m = Measure()
    links: dict[tuple[int, int], list[int]] = {}  # inode -> [seen, nlink, size]

    def visit(st: os.stat_result) -> None:
        m.newest = max(m.newest, st.st_mtime)
        if stat.S_ISREG(st.st_mode):
            rec = links.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])
            rec[0] += 1

    try:
        top = os.lstat(path)
    except OSError:
        return m
    visit(top)
    stack = [str(path)] if stat.S_ISDIR(top.st_mode) else []
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    visit(st)
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
                        if parse_staging_name(e.name):
                            m.nested_staging.append(e.path)
        except OSError:
            continue  # gone, or unreadable: the sums are lower bounds
    for seen, nlink, size in links.values():
        m.size += size
        if seen >= nlink:
            m.freeable += size  # every link is inside: removing the tree frees it
    return m


# ------------------------------------------------------------------------------------------
# scan


def _candidate(path: Path, root: Path, kind: Kind, st: os.stat_result, now: float,
               **kw: Any) -> tuple[Candidate, Measure]:
    m = measure(path)
    c = Candidate(path=path, root=root, kind=kind, decision=Decision.KEPT, reason="",
                  is_dir=stat.S_ISDIR(st.st_mode), ino=(st.st_dev, st.st_ino), mtime=st.st_mtime, size=m.size,
                  freed=m.freeable, age=max(0.0, now - (m.newest or st.st_mtime)), **kw)
    return c, m


def _staging_candidate(path: Path, root: Path, st: os.stat_result, opts: GcOptions, now: float,
                       foreign: str | None) -> Candidate | None:
    state = staging.inspect(path)
    if state.state is not State.NOT_OURS:
        c, _ = _candidate(path, root, Kind.OURS, st, now, owner=state.owner)
        judge_staging(c, state, opts)
        return c
    unreadable = _unreadable(path)
    if foreign and not unreadable:
        return None  # the foreign path takes it, by age (it is not provably ours)
    c, _ = _candidate(path, root, Kind.UNKNOWN, st, now)
    if unreadable:
        c.decide(Decision.KEPT, f"named like ckptctl staging but cannot be read ({unreadable}): whether it "
                                "leaked cannot be told")
        c.error = f"cannot read this staging directory: {unreadable}"
        return c
    c.decide(Decision.KEPT, "named like ckptctl staging but has no ckptctl owner record: not provably ours "
                            "(--preset miles removes such directories by age)")
    return c


def _unreadable(path: Path) -> str | None:
    """Why a directory cannot be listed (permission denied, I/O error), or None."""
    try:
        os.listdir(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _entry_candidate(e: os.DirEntry[str], root: Path, opts: GcOptions, now: float, staging_like: bool,
                     foreign: str | None) -> Candidate | None:
    st = e.stat(follow_symlinks=False)
    path = Path(e.path)
    cand = _staging_candidate(path, root, st, opts, now, foreign) if staging_like else None
    if cand is None and foreign:
        cand, m = _candidate(path, root, Kind.FOREIGN, st, now, match=foreign)
        judge_foreign(cand, opts, m.nested_staging)
    return cand


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
            beside = any(N.is_safetensors(e.name) for e in entries)
            for e in entries:
                # d_type answers is_dir without a syscall; only candidates are stat'ed
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                    staging_like = is_dir and parse_staging_name(e.name) is not None
                    foreign = match(e.name, is_dir=is_dir, beside_safetensors=beside)
                    if not (staging_like or foreign):
                        if is_dir and depth + 1 < opts.max_depth:
                            key = (dev, e.inode())
                            if key not in seen_dirs:
                                seen_dirs.add(key)
                                stack.append((Path(e.path), depth + 1, dev))
                        continue
                    cand = _entry_candidate(e, root, opts, now, staging_like, foreign)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    res.problems.append(GcProblem(e.path, f"cannot stat: {exc.strerror}"))
                    continue
                if cand is not None and cand.ino not in seen_cands:  # never descend into a candidate
                    seen_cands.add(cand.ino)
                    res.candidates.append(cand)
                    if cand.error:
                        res.problems.append(GcProblem(str(cand.path), cand.error))
    res.candidates.sort(key=lambda c: str(c.path))
    return res
