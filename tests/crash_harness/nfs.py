"""The crash campaign on a FUSE mount with NFS semantics (issue 18).

The mount (``tests/fusefs``, its own process) refuses ``renameat2`` flags with EINVAL as the NFS
client does, silly-renames files unlinked while open to ``.nfsXXXX``, and caches dentries and
attributes. So every ``--overwrite`` publishes by the journaled two-rename for real (no
``exchange:EINVAL`` injection), and every cleanup meets NFS's rules.

- :data:`NFS_SCENARIOS`: the small scenarios of :data:`~tests.crash_harness.scenarios.SCENARIOS`
  without the injected EINVAL, named ``<scenario>@nfs``, with the fault points they reach there
  (``two-rename-between`` wherever a destination is replaced);
- :class:`InvariantRunner`: wraps a runner and checks, after every command it runs (the killed
  one, every ``gc-tmp``, every re-run) and before every ``gc-tmp``, the invariant of issue 18
  (:func:`invariant`);
- :func:`run_nfs_trial`: :func:`~tests.crash_harness.trial.run_trial` in a workspace on the
  mount, through an :class:`InvariantRunner`; the invariant's violations join the outcome's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ckptctl import staging
from tests.crash_harness.observe import DEST, our_staging, snapshot
from tests.crash_harness.scenarios import SCENARIOS, Prepared, Scenario
from tests.crash_harness.trial import Fault, Outcome, classify, run_trial

_BASES = ["export-sharded-to-single", "export-single-to-sharded", "export-new-destination", "resave-dtype",
          "resave-repair"]


def _on_nfs(scn: Scenario) -> Scenario:
    points = list(scn.points)
    if "exchange" in points:  # the exchange is refused by the mount: the two-rename follows
        points.insert(points.index("exchange") + 1, "two-rename-between")
    return dataclasses.replace(scn, name=f"{scn.name}@nfs", env={}, points=points,
                               description=f"{scn.description}, on NFS semantics (FUSE)")


NFS_SCENARIOS: dict[str, Scenario] = {s.name: s for s in (_on_nfs(SCENARIOS[b]) for b in _BASES)}


def invariant(ws: Path, prep: Prepared) -> list[str]:
    """Issue 18's invariant on a workspace where no writer runs: some complete version -- the old
    one (the newest published) or the new one (being published) -- is at the destination, or
    recoverable from exactly one sealed staging directory whose state rolls it there. Returns the
    violations (none when it holds)."""
    dst = ws / DEST
    state = classify(dst, prep)
    if state in ("old", "new") or (state == "absent" and prep.old_absent):
        return []
    if state == "mixed":
        return [f"invariant: {dst} holds neither the old nor the new version"]
    rolls = []
    for d in our_staging(ws):
        st = staging.inspect(d)
        if st.state.half_published:
            src = d / (staging.DATA if st.state is staging.State.HALF_PUBLISHED_FORWARD else staging.OLD)
            snap = snapshot(src)
            rolls.append("new" if snap == prep.new_snapshot else "old" if snap == prep.old_snapshot else "mixed")
    if len(rolls) != 1:
        return [f"invariant: {dst} is missing and {len(rolls)} staging directories would roll it ({rolls})"]
    if rolls[0] == "mixed":
        return [f"invariant: {dst} is missing and its staging directory would roll neither version"]
    return []


class _Handle:
    def __init__(self, inner: Any, runner: InvariantRunner, label: str) -> None:
        self.inner, self.runner, self.label = inner, runner, label
        self.pid = inner.pid

    def wait(self, *args: Any, **kw: Any) -> Any:
        res = self.inner.wait(*args, **kw)
        self.runner.check(f"after {self.label}")
        return res


class InvariantRunner:
    """A runner (``ZygoteRunner``/``ExecRunner``) that checks :func:`invariant` on ``ws`` after
    every command and before every ``gc-tmp``; the violations collect in ``violations``."""

    def __init__(self, inner: Any, prep: Prepared, ws: Path) -> None:
        self.inner, self.prep, self.ws = inner, prep, ws
        self.name = inner.name
        self.violations: list[str] = []
        self.checks = 0

    def check(self, when: str) -> None:
        self.checks += 1
        self.violations += [f"{when}: {v}" for v in invariant(self.ws, self.prep)]

    def start(self, argv: list[Any], env: dict[str, str] | None = None, cwd: str | None = None,
              drop_dac: bool = False) -> _Handle:
        if argv[0] == "gc-tmp":
            self.check("before gc-tmp")
        return _Handle(self.inner.start(argv, env=env, cwd=cwd, drop_dac=drop_dac), self, str(argv[0]))

    def run(self, argv: list[Any], env: dict[str, str] | None = None, timeout: float | None = None,
            cwd: str | None = None, drop_dac: bool = False) -> Any:
        h = self.start(argv, env=env, cwd=cwd, drop_dac=drop_dac)
        return h.wait() if timeout is None else h.wait(timeout)


def run_nfs_trial(prep: Prepared, fault: Fault, mnt: Path, runner: Any, *, recovery: str = "gc",
                  poll: bool = False) -> tuple[Outcome, int]:
    """One trial in ``<mnt>/t`` (a mount with NFS semantics), the invariant checked around every
    command. Returns the outcome (the invariant's violations added) and how many checks ran."""
    work = mnt / "t"
    checked = InvariantRunner(runner, prep, work / "ws")
    out = run_trial(prep, fault, work, checked, recovery=recovery, poll=poll)
    # the poller allows an absent destination only where the fallback is injected (EINVAL); here
    # the mount itself refuses the exchange, so the two-rename's window is the same legitimate gap
    # (the invariant above checks that it stays recoverable)
    out.violations = [v for v in out.violations if v != "poller: destination absent"] + checked.violations
    return out, checked.checks
