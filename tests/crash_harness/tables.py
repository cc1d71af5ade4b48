"""The campaign's tables: outcomes counted by command and fault, and their markdown (what
docs/RELIABILITY.md shows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.crash_harness.errno_trial import ErrnoOutcome
from tests.crash_harness.scenarios import ALL_POINTS
from tests.crash_harness.trial import Outcome


def summarize_errno(outcomes: list[ErrnoOutcome]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for o in outcomes:
        family = "export" if o.scenario.startswith(("export", "big-export")) else "resave"
        r = rows.setdefault((family, o.fault), {"command": family, "fault": o.fault, "tried": 0, "exit 3": 0,
                                                "phase named": 0, "old": 0, "new": 0, "lost or mixed": 0,
                                                "staging left": 0, "traceback": 0, "violations": 0})
        r["tried"] += 1
        r["exit 3"] += o.rc == 3
        r["phase named"] += o.phase_named
        r[o.after if o.after in ("old", "new") else "lost or mixed"] += 1
        r["staging left"] += o.staging_left
        r["traceback"] += o.traceback
        r["violations"] += bool(o.violations)
    order = {p: i for i, p in enumerate(ALL_POINTS)}
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], order.get(k[1].split(" at ")[1], 99), k[1]))]


def markdown_rows(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    tot = {h: sum(r[h] for r in rows) for h in head[2:]}
    lines.append("| **total** | | " + " | ".join(f"**{tot[h]}**" for h in head[2:]) + " |")
    return "\n".join(lines)


OUTCOME_COLUMNS = ["old", "new", "window", "lost", "mixed"]


def summarize(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Rows ``fault -> count, outcomes`` (killed trials only; random kills by the phase they hit)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for o in outcomes:
        if not o.killed:
            continue
        fault = o.fault if o.phase is None else f"random kill ({o.phase})"
        family = "export" if o.scenario.startswith(("export", "big-export")) else "resave"
        if "two-rename" in o.scenario:
            family += " (two-rename)"
        key = (family, fault)
        r = rows.setdefault(key, {"command": family, "fault": fault, "kills": 0, **{c: 0 for c in OUTCOME_COLUMNS},
                                  "recovered": 0, "leaked_after_gc": 0, "gc_touched_other": 0,
                                  "rerun_identical": 0, "violations": 0})
        r["kills"] += 1
        r[o.after_kill if o.after_kill in OUTCOME_COLUMNS else "mixed"] += 1
        if o.after_kill == "window" and o.after_recovery in ("old", "new"):
            r["recovered"] += 1
        r["leaked_after_gc"] += o.leaked_after_gc
        r["gc_touched_other"] += int(o.gc_touched_other)
        r["rerun_identical"] += int(o.rerun_identical)
        r["violations"] += int(bool(o.violations))
    order = {p: i for i, p in enumerate(ALL_POINTS)}

    def key(k: tuple[str, str]) -> tuple:
        fam, fault = k
        pt = fault.removeprefix("kill at ")
        return (fam, fault.startswith("random"), order.get(pt, 99), fault)

    return [rows[k] for k in sorted(rows, key=key)]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["command", "fault", "kills", *OUTCOME_COLUMNS, "recovered", "leaked after gc-tmp",
            "gc-tmp touched other", "re-run identical", "trials with a violation"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    tot = {h: 0 for h in head[2:]}
    for r in rows:
        vals = [r["kills"], *(r[c] for c in OUTCOME_COLUMNS), r["recovered"], r["leaked_after_gc"],
                r["gc_touched_other"], r["rerun_identical"], r["violations"]]
        for h, v in zip(head[2:], vals):
            tot[h] += v
        lines.append("| " + " | ".join([r["command"], r["fault"], *map(str, vals)]) + " |")
    lines.append("| **total** | | " + " | ".join(f"**{tot[h]}**" for h in head[2:]) + " |")
    return "\n".join(lines)


def campaign_report(doc: dict[str, Any], out: Path | None, headline: list[str], rows: list[dict[str, Any]]) -> str:
    """A campaign's end: ``doc`` written to ``out`` as JSON (when given), and the text it prints:
    the headline lines, a blank line, the outcome table."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    return "\n".join([*headline, "", markdown_table(rows)])
