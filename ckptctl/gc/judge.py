"""gc-tmp's verdicts: a staging directory from its state (:func:`ckptctl.staging.inspect`) plus
gc's age rules; a foreign entry by age only, unless something live is inside it."""

from __future__ import annotations

from pathlib import Path

from ckptctl import staging
from ckptctl.format.names import HIDDEN_GRACE, is_hidden_staging
from ckptctl.gc.model import Candidate, Decision, GcOptions
from ckptctl.staging import State, StagingState


def format_age(seconds: float) -> str:
    """45s, 12m, 3h05m, 2d04h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def alive_reason(live: staging.Liveness) -> str:
    """Why a staging directory judged alive is kept."""
    return live.reason if live.error else f"writer alive: {live.reason}"


def judge_staging(c: Candidate, st: StagingState, opts: GcOptions) -> None:
    """Decide a staging directory of ours (owner record, or an empty stub) from its state."""
    if st.state is State.WRITING:
        c.decide(Decision.KEPT, alive_reason(st.live))
        c.error = st.live.error
        return
    if is_hidden_staging(c.path.name) and c.age < HIDDEN_GRACE:
        c.decide(Decision.KEPT, f"staging directory not made visible yet, modified {format_age(c.age)} ago: its "
                                f"writer may be starting (kept {format_age(HIDDEN_GRACE)}, whatever --min-age)")
        return
    if st.state is State.STUB:
        if c.age < opts.min_age:
            c.decide(Decision.KEPT, f"empty staging stub modified {format_age(c.age)} ago (< --min-age): "
                                    "its writer may be starting")
        else:
            c.decide(Decision.WOULD_REMOVE, "empty staging stub (no owner record, no data), lock free")
        return
    if st.state is State.CONFLICT:
        assert st.dest is not None
        message, hint = staging.conflict_message(st.dest, st.path)
        c.decide(Decision.KEPT, f"{message}; {hint}")
        c.error = "needs a human: " + message
        return
    owner = st.owner or {}
    if not staging.on_this_host(owner):
        if c.age < max(opts.older_than, opts.min_age):
            c.decide(Decision.KEPT, f"owner on host {owner.get('host')!r}, lock free, but modified "
                                    f"{format_age(c.age)} ago (< --older-than {format_age(opts.older_than)})")
            return
        reason = f"owner on host {owner.get('host')!r}: lock free and idle for {format_age(c.age)}"
    else:
        if c.age < opts.min_age:
            c.decide(Decision.KEPT, f"writer dead ({st.live.reason}) but modified {format_age(c.age)} ago "
                                    "(< --min-age)")
            return
        reason = f"writer dead: {st.live.reason}"
    c.recovery = st.state.recovery
    if c.recovery:
        reason += f"; half-done publish: will {c.recovery} {st.dest}"
    c.decide(Decision.WOULD_REMOVE, reason)


def _lock_held_any(path: Path) -> bool:
    """A foreign directory that happens to hold a held ``lock`` file is somebody's live work."""
    try:
        return staging.probe(path)
    except OSError:
        return False


def live_inside(c: Candidate, nested: list[str]) -> str | None:
    """Why a foreign directory must stay although it is old: it holds a lock someone holds, or a
    ckptctl staging directory whose writer is alive (a paused writer is still a writer)."""
    if not c.is_dir:
        return None
    if _lock_held_any(c.path):
        return f"foreign ({c.match}): a process holds its lock file"
    for d in nested:
        p = Path(d)
        try:
            alive = staging.inspect(p).live.alive
        except OSError:
            alive = True
        if alive:
            return f"foreign ({c.match}): holds the staging directory of a live ckptctl writer ({p.name})"
    return None


def judge_foreign(c: Candidate, opts: GcOptions, nested: list[str]) -> None:
    threshold = max(opts.older_than, opts.min_age)
    why = live_inside(c, nested)
    if why:
        c.decide(Decision.KEPT, why)
    elif c.age < threshold:
        c.decide(Decision.KEPT, f"foreign ({c.match}), judged by age only: modified {format_age(c.age)} ago "
                                f"(< {format_age(threshold)})")
    elif staging.open_elsewhere([c.path]):
        # a download huggingface_hub is still writing, a Trainer still saving: old is not dead
        c.decide(Decision.KEPT, f"foreign ({c.match}): a running process holds it open"
                                + (" (or a file in it)" if c.is_dir else ""))
    else:
        c.decide(Decision.WOULD_REMOVE, f"foreign ({c.match}), judged by age only: idle for {format_age(c.age)} "
                                        f"(>= {format_age(threshold)})")
