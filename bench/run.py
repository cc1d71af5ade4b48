"""Run benchmark cases and print a table.

    python -m bench.run                       # every case, 3 rounds
    python -m bench.run --case inspect-1000 --rounds 5 --json bench/results/inspect.json
    python -m bench.run --list
    python -m bench.run --against 6e3f732 --case metadata-moe   # the working tree and 6e3f732 side by side
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace

from bench.cases import discover
from bench.harness import Case, drop_caches, rss_floor, run_case, table
from bench.revisions import ROOT, TREE, checkout, compare_table, environment_note, remove, side_by_side

from ckptctl.sizes import parse_size


def machine() -> dict:
    import ckptctl

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "ckptctl": ckptctl.__version__}


def _only(case: Case, names: list[str]) -> Case:
    keep = [c for c in case.commands if c.name == case.reference or any(n in c.name for n in names)]
    return replace(case, commands=keep)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", metavar="NAME", help="run only this case (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs of each command (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before every run (root only; ignored otherwise)")
    ap.add_argument("--prefault", metavar="SIZE",
                    help="memory to touch and free before every run, overriding each case's (0 disables)")
    ap.add_argument("--command", action="append", metavar="NAME",
                    help="run only the commands of the selected cases whose name contains NAME (repeatable; "
                         "each case's reference always runs)")
    ap.add_argument("--against", metavar="REV",
                    help="run every ckptctl command for the working tree and for git revision REV side by side")
    ap.add_argument("--keep-checkout", action="store_true",
                    help="with --against: keep the revision's worktree under bench/work for the next run")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)

    cases = discover()
    if args.list:
        for case in cases.values():
            print(f"{case.name:<16} {case.description}")
        return 0
    unknown = sorted(set(args.case or []) - set(cases))
    if unknown:
        ap.error(f"unknown case {', '.join(unknown)}; known: {', '.join(cases)}")
    selected = [cases[n] for n in args.case] if args.case else list(cases.values())
    if args.command:
        selected = [_only(c, args.command) for c in selected]
    rev, notes = None, []
    if args.against:
        rev, path = checkout(args.against)
        _log(f"{args.against} is {rev}, checked out at {path}")
        selected = [side_by_side(c, [(rev, path), (TREE, ROOT)], notes) for c in selected]
    drop = args.drop_caches and drop_caches()
    hot = None if args.prefault is None else 0 if args.prefault.strip() == "0" else parse_size(args.prefault)
    info = {**machine(), "rounds": args.rounds, "warmup": args.warmup,
            "caches": "dropped before each run" if drop else "warm", "prefault_override": hot,
            "rss_floor_mib": round(rss_floor() / 2**20, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_before": os.getloadavg()[0]}
    try:
        rows = [(case, run_case(case, args.rounds, warmup=args.warmup, drop=drop, prefault_bytes=hot, log=_log))
                for case in selected]
    finally:
        if rev and not args.keep_checkout:
            remove(path)

    print(f"{info['date']}  {info['cpus']} CPUs, {info['memory_bytes'] / 2**30:.1f} GiB RAM, "
          f"Linux {info['kernel']}, Python {info['python']}, ckptctl {info['ckptctl']}")
    info["load_after"] = os.getloadavg()[0]
    print(f"{args.rounds} rounds after {args.warmup} warmup, caches {info['caches']}, "
          f"RSS floor {info['rss_floor_mib']} MiB, load {info['load_before']:.2f} -> {info['load_after']:.2f}")
    for case, _ in rows:
        print(f"{case.name}: {case.description}")
    print(table(rows))
    if rev:
        print(f"\n{TREE} against {rev}: {environment_note()}")
        print(compare_table(rows, rev))
        for note in notes:
            print(note)
    if args.json:
        doc = {**info, "against": rev, "cases": [{"name": c.name, "description": c.description, "reference": c.reference,
                                  "prefault_bytes": c.prefault if hot is None else hot,
                                  "commands": [r.to_dict() for r in res]} for c, res in rows]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 1 if any(r.error for _, res in rows for r in res) else 0


if __name__ == "__main__":
    sys.exit(main())
