"""One trial of the signal campaign (issue 15): stop the command at a named point, send it SIGTERM
(what ``kill``, systemd and Kubernetes send) or SIGHUP (a closed terminal), let it go on, and check
that it was handled like Ctrl-C: the documented exit code (128 + the signal), one error line on
stderr and one JSON document on stdout, no traceback, its staging directory removed, the
destination whole (the old version before the publish, the new one after it), and a re-run
byte-identical to a clean run (:func:`run_signal_trial`)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.crash_harness.observe import our_staging, snapshot
from tests.crash_harness.scenarios import PUBLISHED_POINTS, Prepared
from tests.crash_harness.trial import _check_state, _diff, classify
from tests.support.cli import wait_stopped


@dataclass
class SignalOutcome:
    scenario: str
    point: str
    signal: str
    rc: int | None = None
    state: str = "?"  # old | new | absent | mixed, right after the command exited
    staging_left: int = 0
    error_lines: int = 0
    rerun_identical: bool = False
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_signal_trial(prep: Prepared, point: str, signum: int, work: Path, runner: Any) -> SignalOutcome:
    """Stop at ``point`` (``CKPTCTL_STOP_AT``), send ``signum`` then SIGCONT, and check the answer."""
    scn = prep.scn
    t0 = time.monotonic()
    out = SignalOutcome(scn.name, point, signal.Signals(signum).name)
    p = prep.instantiate(work)
    argv = scn.argv(p.src, p.dst) + ["--json"]
    env = dict(scn.env)
    env["CKPTCTL_STOP_AT"] = point
    h = runner.start(argv, env=env)
    wait_stopped(h.pid)
    os.kill(h.pid, signum)  # pending while stopped: delivered when it runs again, at the point
    os.kill(h.pid, signal.SIGCONT)
    res = h.wait()
    out.rc = res.rc
    want = 128 + signum
    if res.rc != want:
        out.violations.append(f"exit {res.rc}, not {want}: {res.stderr[-500:]}")
    try:
        doc = json.loads(res.stdout)
        err = doc["error"]
        if doc["ok"] is not False or err["code"] != "interrupted" or err["exit_code"] != want:
            out.violations.append(f"JSON document: {res.stdout[:500]}")
        if out.signal not in err["message"]:
            out.violations.append(f"the error does not name {out.signal}: {err['message']}")
    except (ValueError, KeyError, TypeError):
        out.violations.append(f"stdout is not one JSON error document: {res.stdout[:500]!r}")
    lines = res.stderr.splitlines()
    out.error_lines = sum(1 for line in lines if line.startswith("error: "))
    if out.error_lines != 1 or "Traceback" in res.stderr:
        out.violations.append(f"stderr: {res.stderr[-800:]}")
    out.staging_left = len(our_staging(p.ws))
    if out.staging_left:
        out.violations.append(f"cleanup left staging: {[d.name for d in our_staging(p.ws)]}")
    state = classify(p.dst, prep)
    if state == "absent" and prep.old_absent:
        state = "old"
    out.state = state
    expect = "new" if point in PUBLISHED_POINTS else "old"
    if state != expect:
        out.violations.append(f"{out.signal} at {point}: the destination is {state}, not {expect}")
    else:
        _check_state(state, p.dst, prep, out, f"after {out.signal}")  # type: ignore[arg-type]
    r = runner.run(argv[:-1] + scn.rerun_extra, env=dict(scn.env))
    if r.rc != 0:
        out.violations.append(f"re-run failed ({r.rc}): {r.stderr[-500:]}")
    else:
        snap = snapshot(p.dst)
        out.rerun_identical = snap == prep.new_snapshot
        if not out.rerun_identical:
            out.violations.append(f"re-run differs from a clean run: {_diff(prep.new_snapshot, snap)}")
    out.seconds = time.monotonic() - t0
    return out
