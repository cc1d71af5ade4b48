"""Injected errors without a kill (``CKPTCTL_FAIL_AT=<point>:<ERRNO>``): the command must fail
cleanly: exit 3, one error line naming the phase and the cause, nothing left behind, the
destination untouched (or, after the publish rename, the complete new version)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.crash_harness.observe import check_marker, check_version, our_staging, snapshot
from tests.crash_harness.scenarios import PUBLISHED_POINTS, Prepared, Scenario
from tests.crash_harness.trial import classify

# fault point -> the phase the error message must name; the error is raised where the next real
# system call of that phase would fail
ERRNO_PHASES = {"write-chunk": "write", "write-data": "write", "fsync-shard": "write", "index": "finalize",
                "extras-written": "finalize", "manifest-written": "finalize", "fsync-dir": "seal",
                "exchange": "publish", "rename-noreplace": "publish", "published": "publish"}
ERRNO_WORDS = {"ENOSPC": "no space left", "EIO": "I/O error", "EXDEV": "different filesystems",
               "EACCES": "permission denied", "EROFS": "read-only"}


@dataclass
class ErrnoOutcome:
    scenario: str
    fault: str  # "<ERRNO> at <point>"
    rc: int | None = None
    phase_named: bool = False
    after: str = "?"  # old | new | mixed | absent
    staging_left: int = 0
    traceback: bool = False
    violations: list[str] = field(default_factory=list)


def run_errno_trial(prep: Prepared, point: str, err: str, work: Path, runner: Any) -> ErrnoOutcome:
    """``CKPTCTL_FAIL_AT=<point>:<err>``: exit 3, one error line naming the phase and the cause, no
    traceback, nothing left behind, and the destination untouched. After the publish rename
    (``published``) the destination is the complete new version instead."""
    out = ErrnoOutcome(prep.scn.name, f"{err} at {point}")
    p = prep.instantiate(work)
    before = snapshot(p.ws)
    env = {**prep.scn.env, "CKPTCTL_FAIL_AT": f"{point}:{err}"}
    try:
        r = runner.run(prep.scn.argv(p.src, p.dst), env=env)
    except TimeoutError as exc:
        out.violations.append(f"hang: {exc}")
        return out
    out.rc = r.rc
    out.traceback = "Traceback" in r.stderr
    out.phase_named = f"(phase: {ERRNO_PHASES[point]})" in r.stderr
    out.staging_left = len(our_staging(p.ws))
    out.after = classify(p.dst, prep)
    if out.after == "absent" and prep.old_absent:
        out.after = "old"
    if r.rc != 3:
        out.violations.append(f"exit {r.rc}, expected 3: {r.stderr[-300:]}")
    if out.traceback or "error:" not in r.stderr or ERRNO_WORDS[err] not in r.stderr:
        out.violations.append(f"not a one-line error naming the cause: {r.stderr[-300:]}")
    if not out.phase_named:
        out.violations.append(f"the message does not name the phase {ERRNO_PHASES[point]}: {r.stderr[-300:]}")
    if out.staging_left:
        out.violations.append("staging left behind")
    expected = "new" if point in PUBLISHED_POINTS else "old"
    if out.after != expected:
        out.violations.append(f"destination is {out.after}, expected {expected}")
    elif expected == "old" and snapshot(p.ws) != before:
        out.violations.append("something in the destination's parent changed")
    elif expected == "new":
        out.violations += check_version(p.dst, prep.new_tensors) + check_marker(p.dst)
    if not out.violations:
        shutil.rmtree(work, ignore_errors=True)
    return out


def errno_faults(scn: Scenario) -> list[tuple[str, str]]:
    """The injected errors a scenario can meet: one per phase it reaches."""
    table = [("write-chunk", "ENOSPC"), ("write-data", "EIO"), ("fsync-shard", "EIO"), ("index", "ENOSPC"),
             ("extras-written", "EIO"), ("manifest-written", "ENOSPC"), ("fsync-dir", "EIO"),
             ("exchange", "EIO"), ("exchange", "EXDEV"), ("rename-noreplace", "ENOSPC"), ("published", "EIO")]
    return [(pt, e) for pt, e in table if pt in scn.points]
