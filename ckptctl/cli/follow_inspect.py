"""`ckptctl inspect DST_ROOT` of a follower's DST_ROOT: what it published, lost and removed.

Imported by ``inspect_cmd`` only when the path holds ``.ckptctl-follow/``; the state is read by
``ckptctl.follow.view`` (data), rendered here. With ``--json`` the document holds ``path``,
``format`` ``"follow-root"`` and ``follow`` (docs/CLI_JSON.md, docs/schemas/inspect.schema.json).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

FORMAT = "follow-root"


def show(out: Any, path: Path, *, json_: bool) -> None:
    from ckptctl.follow.view import read_view

    view = read_view(path)
    if json_:
        out.emit_json(out.document(True, path=str(path), format=FORMAT, follow=view.to_dict()))
        return
    render(out, str(path), view)


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at is not None else ""


def _holder(who: dict[str, Any] | None) -> str:
    if who is None:
        return "none recorded"
    live = {True: "running", False: "not running", None: "cannot tell"}[who.get("live")]
    since = f", since {_when(who['since'])}" if who.get("since") is not None else ""
    return f"pid {who.get('pid') or '?'} on {who.get('host') or '?'}: {live} ({who.get('why')}){since}"


def _hook(row: Any) -> str:
    if row.on_publish == "failed" and row.exit_code is not None:
        return f"exit {row.exit_code}"
    return row.on_publish or ""


def render(out: Any, path: str, view: Any) -> None:
    from rich.table import Table

    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("path", path)
    summary.add_row("format", "a follower's DST_ROOT (export --follow)")
    summary.add_row("source", view.source or "?")
    if view.start_from:
        summary.add_row("from", view.start_from + (f" (baseline step {view.baseline})" if view.baseline is not None
                                                   else ""))
    summary.add_row("holder", _holder(view.holder))
    if view.holder and view.holder.get("command"):
        summary.add_row("command", view.holder["command"])
    counts = view.counts()
    summary.add_row("saves", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) if counts else "none")
    out.print(summary)
    if view.saves:
        t = Table(title="saves", title_justify="left")
        for col in ("step", "name", "state", "verified", "on-publish", "time"):
            t.add_column(col, justify="right" if col == "step" else "left")
        for row in view.saves:
            verified = "" if row.verified is None else "yes" if row.verified else "FAILED"
            state = row.status + (f": {row.reason}" if row.reason and row.status != "waiting" else "")
            t.add_row("" if row.step is None else str(row.step), row.name, state, verified, _hook(row),
                      _when(row.at))
        out.print(t)
    for note in view.notes:
        out.note(note)
