"""One trial of the crash campaign: run the command, SIGKILL it at a fault (a named point or a
random moment), then check I1, I2, I4 and I8 on what it left (:func:`run_trial`)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.crash_harness.observe import (DEST, attributable, check_marker, check_version, infer_phase, is_stub,
                                         our_staging, snapshot, wait_for_staging)
from tests.crash_harness.poller import Poller
from tests.crash_harness.scenarios import PUBLISHED_POINTS, Prepared
from tests.support import MANIFEST


@dataclass
class Fault:
    kind: str  # "point" | "random"
    point: str | None = None
    delay: float | None = None  # random: seconds after the staging directory appeared
    env: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.kind == "point":
            return f"kill at {self.point}"
        return "kill at a random moment"


@dataclass
class Outcome:
    scenario: str
    fault: str
    runner: str
    recovery: str  # "gc" (gc-tmp first, then the re-run) or "rerun" (the re-run cleans up alone)
    delay: float | None = None
    rc: int | None = None
    killed: bool = False
    phase: str | None = None  # random kills: where the writer was, judged from what it left
    after_kill: str = "?"  # old | new | window | lost | mixed
    after_recovery: str = "?"  # old | new after gc-tmp / the re-run's own recovery
    staging_left: int = 0  # staging directories the kill left
    gc_removed: int = 0
    leaked_after_gc: int = 0
    stubs_left_for_gc: int = 0  # recovery "rerun": empty stubs the re-run left for gc-tmp
    gc_touched_other: bool = False
    manifest_present: bool = False
    rerun_identical: bool = False
    poll: dict[str, Any] | None = None
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify(dst: Path, prep: Prepared) -> str:
    if not os.path.lexists(dst):
        return "absent"
    snap = snapshot(dst)
    if not prep.old_absent and snap == prep.old_snapshot:
        return "old"
    if snap == prep.new_snapshot:
        return "new"
    return "mixed"


def _diff(a: dict[str, str], b: dict[str, str]) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k}: {a.get(k, '-')[:12]} -> {b.get(k, '-')[:12]}" for k in keys if a.get(k) != b.get(k))[:400]


def _check_state(state: str, dst: Path, prep: Prepared, out: Outcome, when: str) -> None:
    if state == "old":
        if prep.old_tensors is not None:
            out.violations += [f"{when}: old version: {p}" for p in check_version(dst, prep.old_tensors)]
            out.violations += [f"{when}: old version: {p}" for p in check_marker(dst)]
    elif state == "new":
        out.violations += [f"{when}: new version: {p}" for p in check_version(dst, prep.new_tensors)]
        out.violations += [f"{when}: new version: {p}" for p in check_marker(dst)]
    elif state == "mixed":
        base = prep.old_snapshot if not prep.old_absent else prep.new_snapshot
        out.violations.append(f"{when}: destination is neither the old nor the new version: "
                              f"{_diff(base, snapshot(dst))}")


def run_trial(prep: Prepared, fault: Fault, work: Path, runner: Any, *, recovery: str = "gc",
              poll: bool = False, keep: bool = False) -> Outcome:
    """One kill and every check after it. ``work`` is a scratch directory (replaced)."""
    scn = prep.scn
    t0 = time.monotonic()
    out = Outcome(scn.name, fault.label, runner.name, recovery, delay=fault.delay)
    p = prep.instantiate(work)
    argv = scn.argv(p.src, p.dst)
    bystanders = snapshot(p.ws, skip=lambda rel: rel == DEST or rel.startswith(DEST + "/"))
    src_before = snapshot(p.src)
    env = dict(scn.env)
    env.update(fault.env)
    if fault.kind == "point":
        env["CKPTCTL_KILL_AT"] = fault.point or ""
    poller = Poller(p.dst, prep.versions(), absent_ok="CKPTCTL_FAIL_AT" in env or prep.old_absent) if poll else None
    try:
        if poller:
            poller.__enter__()
        try:
            h = runner.start(argv, env=env)
            if fault.kind == "random":
                wait_for_staging(p.ws, h.pid)
                time.sleep(fault.delay or 0)
                try:
                    os.kill(h.pid, signal.SIGKILL)  # not yet reaped: the pid is still ours
                except ProcessLookupError:
                    pass
            res = h.wait()
        finally:
            if poller:
                poller.__exit__(None, None, None)
        out.rc = res.rc
        out.killed = res.rc == -signal.SIGKILL
        if poller:
            out.poll = asdict(poller.stats)
            out.violations += [f"poller: {v}" for v in poller.stats.violations[:5]]
        if fault.kind == "point" and not out.killed:
            out.violations.append(f"the command did not reach {fault.point} (exit {res.rc}): {res.stderr[-500:]}")
        if not out.killed and res.rc != 0:
            out.violations.append(f"exit {res.rc}: {res.stderr[-500:]}")
        if fault.kind == "random":
            out.phase = infer_phase(p.ws) if out.killed else "completed"

        # --- I1 / I2 right after the kill
        leftovers = our_staging(p.ws)
        out.staging_left = len(leftovers)
        for d in leftovers:
            why = attributable(d)
            if why:
                out.violations.append(f"I4: unattributable leftover: {why}")
        state = classify(p.dst, prep)
        if state == "absent":
            if prep.old_absent:
                state = "old"
            elif any((d / "old").is_dir() for d in leftovers):
                state = "window"  # exchange-less publish between its two renames: gc-tmp finishes it
            else:
                state = "lost"
                out.violations.append("I1: the destination is gone and nothing can bring it back")
        out.after_kill = state
        if out.phase == "before-staging-or-done":
            out.phase = "before staging" if state == "old" else "after cleanup"
        elif fault.kind == "random" and out.killed and state == "new":
            out.phase = "after publish"
        if state in ("old", "new", "mixed") and os.path.lexists(p.dst):
            _check_state(state, p.dst, prep, out, "after kill")
            out.manifest_present = (p.dst / MANIFEST).exists()
        if fault.kind == "point" and fault.point and state in ("old", "new"):
            expect_new = fault.point in PUBLISHED_POINTS
            if expect_new != (state == "new"):
                out.violations.append(f"I1: killed at {fault.point} but found the {state} version")

        # --- I4: gc-tmp removes every leftover and nothing else (or the re-run's own recovery)
        def rerun() -> None:
            r = runner.run(argv + scn.rerun_extra, env=dict(scn.env))
            if r.rc != 0:
                out.violations.append(f"I8: re-run failed ({r.rc}): {r.stderr[-500:]}")
                return
            snap = snapshot(p.dst)
            out.rerun_identical = snap == prep.new_snapshot
            if not out.rerun_identical:
                out.violations.append(f"I8: re-run differs from a clean run: {_diff(prep.new_snapshot, snap)}")
            # the re-run removes a dead writer's staging directory (recover_destination); an empty
            # stub (a kill during the last steps of the cleanup: owner record already gone) has
            # nothing to attribute, and is gc-tmp's (as a stub)
            left = [d for d in our_staging(p.ws) if not is_stub(d)]
            out.stubs_left_for_gc = len(our_staging(p.ws)) - len(left)
            if left:
                out.violations.append(f"re-run left staging behind: {[d.name for d in left]}")

        def gc() -> None:
            before = snapshot(p.ws, skip=lambda rel: rel.split("/")[0] in {d.name for d in our_staging(p.ws)}
                              or (state == "window" and rel.split("/")[0] == DEST))
            r = runner.run(["gc-tmp", str(p.ws), "--min-age", "0", "--json"])
            if r.rc != 0:
                out.violations.append(f"I4: gc-tmp exited {r.rc}: {r.stderr[-500:]}")
                return
            doc = json.loads(r.stdout)
            out.gc_removed += doc["removed"]
            left = our_staging(p.ws)
            out.leaked_after_gc = len(left)
            if left:
                out.violations.append(f"I4: gc-tmp left {[d.name for d in left]}")
            after = snapshot(p.ws, skip=lambda rel: state == "window" and rel.split("/")[0] == DEST)
            if after != before:
                out.gc_touched_other = True
                out.violations.append(f"I4: gc-tmp changed something that is not staging: {_diff(before, after)}")

        if recovery == "gc":
            gc()
        else:
            rerun()
        if not our_staging(p.ws) or recovery == "rerun":
            st = classify(p.dst, prep)
            if st == "absent" and prep.old_absent:
                st = "old"
            out.after_recovery = st
            if recovery == "gc":
                if st not in ("old", "new"):
                    out.violations.append(f"I1: after gc-tmp the destination is {st}")
                elif state in ("old", "new") and st != state:
                    out.violations.append(f"gc-tmp changed the destination from {state} to {st}")
                else:
                    _check_state(st, p.dst, prep, out, "after gc-tmp")
        if recovery == "gc":
            rerun()
        else:
            gc()  # nothing of ours may be left for it
        if recovery == "rerun" and out.gc_removed > out.stubs_left_for_gc:
            out.violations.append(f"the re-run left {out.gc_removed} staging directories for gc-tmp")

        # --- nothing else was touched
        if snapshot(p.ws, skip=lambda rel: rel == DEST or rel.startswith(DEST + "/")) != bystanders:
            out.violations.append("a bystander in the destination's parent changed")
        if snapshot(p.src) != src_before:
            out.violations.append("the source changed")
    except TimeoutError as exc:
        out.violations.append(f"hang: {exc}")
    finally:
        out.seconds = time.monotonic() - t0
        if not keep and not out.violations:
            shutil.rmtree(work, ignore_errors=True)
    return out


def random_fault(rng: random.Random, prep: Prepared, spread: float = 1.15) -> Fault:
    """A SIGKILL at a moment drawn uniformly from the time a clean run spends after creating its
    staging directory (writing, finalizing, publishing, cleaning up), and a little past it so the
    end of the run is in range too (some runs complete)."""
    return Fault("random", delay=round(rng.uniform(0.0, max(prep.staged_seconds, 0.01) * spread), 4))
