"""Retention of the follower's own exports: which to keep, and the removal of one.

Rules (each optional; none given: everything is kept): ``--keep-last K`` keeps the K newest
exports, ``--keep-every N`` those whose step is a multiple of N, ``--keep-best METRIC`` the one
with the best value of METRIC as the trainer logged it (``trainer_state.json``'s
``log_history``: the last value at or before the save's step, recorded when it was exported;
lower is better when the name ends in ``loss``, as the Trainer decides, else higher; ``:min`` or
``:max`` after the name says it). An export is kept if any rule keeps it, and the newest is
always kept. Only exports *older* than the newest one published (with ``--verify``: the newest
that verified clean) are ever removed, so an export goes only once its replacement is durable
(and checked). Steps are compared as integers.

Only what the follower published is removed: a record says it published ``DST_ROOT/<name>``,
and the directory there must still be the one it published (same device and inode). The
removal is a rename of that directory into a staging directory of ours (owner record, lock), a
second check of the directory moved (a directory put in the export's place just before the rename
is put back, untouched), then the staging package's removal, which never follows a link nor crosses a mount: a follower killed
at any point leaves either the export, or a staging directory ``gc-tmp`` attributes and removes
(the next follower does too).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptctl import _faults
from ckptctl.errors import UsageError, from_oserror
from ckptctl.staging import fsync_path

MAX_METRICS = 128


@dataclass(frozen=True)
class Retention:
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: str | None = None  # the metric's name as logged
    best_lower: bool = True

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))

    @classmethod
    def of(cls, keep_last: int | None, keep_every: int | None, keep_best: str | None) -> Retention:
        """Validated rules (UsageError, exit 2, on a bad value)."""
        if keep_last is not None and keep_last < 1:
            raise UsageError(f"--keep-last must be at least 1, not {keep_last}", "e.g. --keep-last 3")
        if keep_every is not None and keep_every < 1:
            raise UsageError(f"--keep-every must be at least 1, not {keep_every}", "e.g. --keep-every 1000")
        lower = True
        if keep_best is not None:
            name, _, mode = keep_best.partition(":")
            if not name or mode not in ("", "min", "max"):
                raise UsageError(f"--keep-best {keep_best!r} is not METRIC, METRIC:min or METRIC:max",
                                 "e.g. --keep-best eval_loss or --keep-best eval_accuracy:max")
            lower = mode == "min" if mode else name.endswith("loss")
            keep_best = name
        return cls(keep_last, keep_every, keep_best, lower)

    def metric(self, record: dict[str, Any]) -> float | None:
        """The record's value of the --keep-best metric (the Trainer's ``eval_`` prefix optional)."""
        metrics = record.get("metrics") or {}
        assert self.keep_best is not None
        for name in (self.keep_best, "eval_" + self.keep_best):
            v = metrics.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                return float(v)
        return None


def to_remove(records: list[dict[str, Any]], rules: Retention, *, verify: bool) -> list[dict[str, Any]]:
    """The published records the rules let go, oldest first (module docstring)."""
    published = sorted((r for r in records if r.get("status") == "published"), key=lambda r: (r["step"], r["name"]))
    if not rules.active or not published:
        return []
    anchors = [r for r in published if r.get("verified")] if verify else published
    if not anchors:
        return []
    boundary = (anchors[-1]["step"], anchors[-1]["name"])
    keep = {published[-1]["name"], anchors[-1]["name"]}
    if rules.keep_last is not None:
        keep.update(r["name"] for r in published[-rules.keep_last:])
    if rules.keep_every is not None:
        keep.update(r["name"] for r in published if r["step"] % rules.keep_every == 0)
    if rules.keep_best is not None:
        scored = [(v, r["step"], r["name"]) for r in published if (v := rules.metric(r)) is not None]
        if scored:
            best = min(scored) if rules.best_lower else max(scored, key=lambda t: (t[0], -t[1]))
            keep.add(best[2])
    return [r for r in published if r["name"] not in keep and (r["step"], r["name"]) < boundary]


MAX_TREE = 100_000


def tree_ids(path: Path) -> dict[str, int] | None:
    """Every entry below ``path`` (links not followed) by relative path -> inode number; None when
    it cannot be read or holds more than :data:`MAX_TREE` entries."""
    out: dict[str, int] = {}
    todo = [("", os.fspath(path))]
    try:
        while todo:
            prefix, where = todo.pop()
            with os.scandir(where) as it:
                for e in it:
                    out[prefix + e.name] = e.inode()
                    if len(out) > MAX_TREE:
                        return None
                    if e.is_dir(follow_symlinks=False):
                        todo.append((prefix + e.name + "/", e.path))
    except OSError:
        return None
    return out


def still_ours(dest: Path, record: dict[str, Any]) -> bool:
    """``dest`` is exactly what the record says the follower published: the same directory
    (device, inode) holding the same entries (names, inodes). A directory made in its place
    (which may get the freed inode number) or one a user added to or took from is not."""
    ident = record.get("dest_id") or {}
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (ident.get("dev"), ident.get("ino")):
        return False
    files = record.get("dest_files")
    return isinstance(files, dict) and tree_ids(dest) == files


def remove_export(dest: Path, record: dict[str, Any], *, fsync: bool, command: str) -> bool:
    """Move ``dest`` into a new staging directory of ours, check that what was moved is the export
    ``record`` published (the object moved, not the name looked at before: a directory put in its
    place between the caller's check and the rename is caught), then remove it (module
    docstring). False, and nothing removed, when it is not: it is put back where it was. Raises a
    CkptctlError when it cannot be moved, or moved back."""
    from ckptctl.publish import Stage

    stage = Stage(dest, fsync=fsync, command=command, known={})
    data = stage.create()
    try:
        _faults.point("follow-remove-staged")
        os.rename(dest, data)  # onto the empty data/: the export leaves DST_ROOT whole, at once
        if fsync:
            fsync_path(dest.parent, directory=True)
        _faults.point("follow-remove-moved")
    except OSError as exc:
        stage.abort()
        raise from_oserror(exc, f"cannot remove {dest}", phase="retention") from None
    if not still_ours(data, record):
        _put_back(stage, data, dest)
        return False
    stage.published = True  # data/ holds the export now: finish removes it (abort would too)
    stage.finish()
    return True


def _put_back(stage: Any, data: Path, dest: Path) -> None:
    """``data`` (not the follower's export) back at ``dest``, never replacing anything; when
    something appeared there meanwhile, the staging directory is kept with it (never removed) and
    the error says where."""
    from ckptctl.errors import CkptctlError, OperationalError
    from ckptctl.publish import rename_into_place

    try:
        rename_into_place(data, dest)
    except (OSError, CkptctlError) as exc:
        aside = dest.parent / f"{dest.name}.kept-by-ckptctl-{os.getpid()}"  # not a staging name: no
        try:  # recovery nor gc-tmp ever removes it
            rename_into_place(data, aside)
        except (OSError, CkptctlError):
            stage.kept = True
            aside = data
        stage.finish()
        raise OperationalError(f"{dest} was replaced while retention removed it, and cannot be put back "
                               f"({exc}): it is kept, untouched, as {aside}",
                               f"move {aside} back where it belongs", phase="retention") from None
    stage.finish()


def metrics_of(trainer_state: Any, step: int) -> dict[str, float]:
    """Every number the Trainer logged at or before ``step`` (the last value of each), and its
    ``best_metric``: what ``--keep-best`` chooses by, recorded with the export."""
    out: dict[str, float] = {}
    if not isinstance(trainer_state, dict):
        return out
    history = trainer_state.get("log_history")
    for entry in history if isinstance(history, list) else ():
        if not isinstance(entry, dict):
            continue
        at = entry.get("step")
        if isinstance(at, int) and at > step:
            continue
        for k, v in entry.items():
            if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                if k in out or len(out) < MAX_METRICS:
                    out[k] = float(v)
    best = trainer_state.get("best_metric")
    if isinstance(best, (int, float)) and not isinstance(best, bool):
        out["best_metric"] = float(best)
    return out
