"""The long crash campaign on NFS semantics (issue 18): the kill matrix on a FUSE mount that
refuses renameat2 flags, silly-renames open files and caches dentries (``tests/fusefs``).

    python -m bench.nfs_campaign --kills 150 --seed 18 --out bench/results/nfs-campaign.json

Rounds kill every scenario of ``crash_harness.nfs.NFS_SCENARIOS`` at every fault point it reaches;
between rounds, kills at random moments. Trials alternate between gc-tmp first and the re-run
recovering alone; about a third have a reader polling the destination (it holds files of the old
version open, so the writer's cleanup of ``old/`` is deferred by NFS's silly rename). The
invariant of issue 18 is checked after every command and before every gc-tmp. Prints the table
docs/RELIABILITY.md shows; exit status 1 when any trial broke an invariant.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests import crash_harness as H
from tests.crash_harness.nfs import NFS_SCENARIOS, run_nfs_trial
from tests.fusefs import mounted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=150, help="stop once this many processes were killed (default 150)")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every named fault point (default 2)")
    ap.add_argument("--cache", type=float, default=60.0, help="the mount's dentry/attribute cache, seconds")
    ap.add_argument("--out", type=Path, default=None, help="write every outcome and the table as JSON here")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="ckptctl-nfs-"))
    zygote = H.ZygoteRunner()
    started = time.monotonic()
    outcomes: list[H.Outcome] = []
    checks = 0
    try:
        with mounted(work / "fuse", refuse_rename_flags=True, silly="nfs", cache=args.cache) as m:
            preps = [H.Prepared(s, work / "prep" / name, zygote) for name, s in NFS_SCENARIOS.items()]

            def trial(prep: H.Prepared, fault: H.Fault) -> None:
                nonlocal checks
                n = len(outcomes)
                o, c = run_nfs_trial(prep, fault, m.mnt, zygote, recovery="gc" if n % 2 else "rerun",
                                     poll=n % 3 == 0)
                outcomes.append(o)
                checks += c
                if o.violations:
                    print(f"  VIOLATION ({prep.scn.name}, {fault.label}): {o.violations[:3]}", file=sys.stderr)

            rounds = 0
            while sum(o.killed for o in outcomes) < args.kills:
                if rounds < args.rounds:
                    for prep in preps:
                        for point in prep.scn.points:
                            trial(prep, H.Fault("point", point))
                    rounds += 1
                else:
                    prep = preps[rng.randrange(len(preps))]
                    trial(prep, H.random_fault(rng, prep, spread=0.6))
            faults = {k: len(m.faults(k)) for k in ("rename-flags-refused", "silly-rename")}
    finally:
        zygote.close()
    seconds = time.monotonic() - started
    rows = H.summarize(outcomes)
    bad = [o for o in outcomes if o.violations]
    doc = {"seconds": round(seconds, 1), "trials": len(outcomes), "kills": sum(o.killed for o in outcomes),
           "invariant_checks": checks, "mount_faults": faults, "violations": len(bad), "table": rows,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "outcomes": [o.to_dict() for o in outcomes]}
    print(H.campaign_report(doc, args.out, [
        f"{len(outcomes)} trials, {doc['kills']} kills, {checks} invariant checks, {seconds:.0f}s; "
        f"the mount refused {faults['rename-flags-refused']} flagged renames and silly-renamed "
        f"{faults['silly-rename']} open files"], rows))
    if bad:
        print(f"\n{len(bad)} trials broke an invariant")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
