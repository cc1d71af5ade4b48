"""What a follower has done in ``DST_ROOT``, read from its state (``inspect DST_ROOT``).

A reader, never a writer: the lock is not taken (a probe would take it for a moment, and a
follower starting then would be refused), so whether the holder is live is judged from its
record: on this host, its pid still running with the same start time and boot id; on another
host, unknown. Every file is read as the follower reads its own (``format.small``: bounded,
``O_NOFOLLOW``, regular files only, never waiting on a FIFO), at most :data:`MAX_RECORDS` records.
A DST_ROOT may be shared, so a record is a stranger's file: one that cannot be read, is not
ours, is not named after its save, or holds a field of the wrong type gives a note and is left
out (or that field is), never a traceback. Text from a record is bounded and its control
characters escaped (a terminal is never sent an escape sequence from a file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptctl.follow.state import HOLDER, MAX_RECORD_BYTES, SAVES, SETTINGS, STATE_DIR

STATUSES = ("waiting", "exporting", "published", "lost", "refused", "blocked", "skipped", "removing", "removed",
            "released")
MAX_RECORDS = 10_000
MAX_TEXT = 400
MAX_SMALL = 1 << 16


@dataclass
class SaveRow:
    """One save as the follower recorded it."""

    name: str
    step: int | None
    status: str
    verified: bool | None = None
    on_publish: str | None = None  # pending, ok, failed, timeout (the --on-publish command's status)
    exit_code: int | None = None  # the --on-publish command's
    at: float | None = None  # when its record last changed (its last event)
    reason: str | None = None  # why it was lost, refused or is waiting

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "status": self.status, "verified": self.verified,
                "on_publish": self.on_publish, "on_publish_exit_code": self.exit_code, "at": self.at,
                "reason": self.reason}


@dataclass
class FollowView:
    """``DST_ROOT``'s follower state: who holds (or last held) it, what it follows, every save."""

    root: str
    state: str
    source: str | None = None
    start_from: str | None = None
    baseline: int | None = None
    holder: dict[str, Any] | None = None  # pid, host, command, since, live (None: cannot tell), why
    saves: list[SaveRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.saves:
            out[row.status] = out.get(row.status, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "source": self.source, "from": self.start_from, "baseline": self.baseline,
                "holder": self.holder, "counts": self.counts(), "saves": [r.to_dict() for r in self.saves],
                "notes": list(self.notes)}


def is_follow_root(path: Path) -> bool:
    """``path`` holds a follower's state directory (a real directory, not a link)."""
    try:
        return os.path.isdir(path / STATE_DIR) and not os.path.islink(path / STATE_DIR)
    except OSError:
        return False


def read_view(dst_root: Path) -> FollowView:
    """Everything the state says, by step; what cannot be read is a note (module docstring)."""
    state_dir = dst_root / STATE_DIR
    view = FollowView(str(dst_root), str(state_dir))
    settings = _doc(state_dir / SETTINGS, MAX_SMALL, view.notes)
    if settings is not None:
        view.source = _text(settings.get("source"))
        view.start_from = _text(settings.get("from"))
        view.baseline = _int(settings.get("baseline"))
    who = _doc(state_dir / HOLDER, MAX_SMALL, view.notes)
    if who is not None:
        view.holder = _holder(who)
    view.saves = _rows(state_dir / SAVES, view.notes)
    return view


def _rows(saves_dir: Path, notes: list[str]) -> list[SaveRow]:
    if os.path.islink(saves_dir):
        notes.append(f"{saves_dir} is a link, not the follower's own directory; not read")
        return []
    try:
        with os.scandir(saves_dir) as it:
            names, more = [], 0
            for e in it:
                if not e.name.endswith(".json") or e.name.startswith("."):
                    continue
                if len(names) < MAX_RECORDS:
                    names.append(e.name)
                else:
                    more += 1
    except FileNotFoundError:
        return []
    except OSError as exc:
        notes.append(f"{saves_dir}: cannot be listed ({exc.strerror or exc})")
        return []
    if more:
        notes.append(f"{saves_dir}: {more:,} more records than the {MAX_RECORDS:,} read; not shown")
    rows = []
    for n in sorted(names):
        doc = _doc(saves_dir / n, MAX_RECORD_BYTES, notes, f"{SAVES}/{_text(n)}")
        if doc is not None:
            row = _row(n, doc, notes)
            if row is not None:
                rows.append(row)
    rows.sort(key=lambda r: (r.step if r.step is not None else -1, r.name))
    return rows


def _row(filename: str, doc: dict[str, Any], notes: list[str]) -> SaveRow | None:
    from ckptctl.format import names as N

    where = f"{SAVES}/{_text(filename)}"
    name = doc.get("name")
    if not isinstance(name, str) or name + ".json" != filename or N.destination_problem(name) is not None:
        notes.append(f"{where}: not the record of a save of that name; left out")
        return None
    status = doc.get("status")
    if status not in STATUSES:
        notes.append(f"{where}: unknown status {_text(repr(status)[:60])}; left out")
        return None
    row = SaveRow(name, _checked(doc, "step", int, where, notes), status)
    verified = doc.get("verified")
    if isinstance(verified, bool) or verified is None:
        row.verified = verified
    else:
        notes.append(f"{where}: 'verified' is not true, false or null")
    hook = doc.get("on_publish")
    if isinstance(hook, dict):
        row.on_publish = _hook_status(hook)
        row.exit_code = _int(hook.get("exit_code"))
    elif hook is not None:
        notes.append(f"{where}: 'on_publish' is not an object")
    events = doc.get("events")
    last = events[-1] if isinstance(events, list) and events and isinstance(events[-1], dict) else {}
    at = last.get("at", doc.get("removed_at", doc.get("published_at")))
    row.at = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None
    reason = last.get("reason") if status in ("lost", "refused", "blocked") else doc.get("reason")
    row.reason = _text(reason) if reason is not None else None
    return row


def _hook_status(hook: dict[str, Any]) -> str | None:
    status = hook.get("status")
    if status == "done":  # a record written before the status said how it ended
        return "ok" if hook.get("exit_code") == 0 else "failed"
    return status if status in ("pending", "ok", "failed", "timeout") else None


def _holder(who: dict[str, Any]) -> dict[str, Any]:
    from ckptctl.staging.liveness import judge_owner, on_this_host

    since = who.get("since")
    out = {"pid": _int(who.get("pid")), "host": _text(who.get("host")), "command": _text(who.get("command")),
           "since": float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None}
    if not on_this_host(who):
        out.update(live=None, why="on another host: cannot tell from here")
    else:
        # the owner record alone speaks (locked=True): the lock is never probed (module docstring)
        judged = judge_owner(Path("/nonexistent"), who, locked=True)
        out.update(live=judged.alive, why=_text(judged.reason))
    return out


def _doc(path: Path, limit: int, notes: list[str], label: str | None = None) -> dict[str, Any] | None:
    """A JSON document of ours at ``path``, or None (and a note unless it is simply absent)."""
    from ckptctl.format import small
    from ckptctl.staging.record import TOOL

    label = label or _text(path.name)
    try:
        doc = small.read_json(path, limit=limit)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        notes.append(f"{label}: unreadable ({_text(why)}); left out")
        return None
    if not isinstance(doc, dict) or doc.get("tool") != TOOL:
        notes.append(f"{label}: not a record of ckptctl's; left out")
        return None
    return doc


def _checked(doc: dict[str, Any], key: str, kind: type, where: str, notes: list[str]) -> Any:
    value = doc.get(key)
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    notes.append(f"{where}: {key!r} is not {'an integer' if kind is int else kind.__name__}")
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    """A string from a record, bounded, its control characters escaped; None for anything else."""
    if not isinstance(value, str):
        return None
    if len(value) > MAX_TEXT:
        value = value[:MAX_TEXT] + "..."
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
        value = "".join(c if not (ord(c) < 32 or 127 <= ord(c) < 160) else repr(c)[1:-1] for c in value)
    return value
