"""gc-tmp's options, candidates, decisions and result (what the CLI renders)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class Kind(enum.StrEnum):
    OURS = "ours"  # a ckptctl staging directory (owner record, or an empty stub)
    FOREIGN = "foreign"  # matched by a --preset or --pattern, judged by age only
    UNKNOWN = "unknown"  # named like ckptctl staging, not provably ours: kept


class Decision(enum.StrEnum):
    """Final decisions, with the strings the JSON output uses."""

    REMOVED = "removed"
    WOULD_REMOVE = "would-remove"
    KEPT = "kept"
    DEFERRED = "deferred"  # NFS silly-renamed files still open: the next run finishes the job
    FAILED = "failed"
    VANISHED = "vanished"  # gone before we got to it (another gc run, or its writer finished)


_LEAKED = (Decision.REMOVED, Decision.WOULD_REMOVE, Decision.DEFERRED, Decision.FAILED)


@dataclass
class GcOptions:
    older_than: float = 3600.0  # foreign entries, and ours whose owner is on another host
    min_age: float = 60.0  # nothing modified more recently than this is ever removed
    max_depth: int = 4  # 1 = only the root's own entries
    presets: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    dry_run: bool = False


@dataclass
class Candidate:
    path: Path
    root: Path
    kind: Kind
    decision: Decision
    reason: str
    owner: dict[str, Any] | None = None
    match: str | None = None  # foreign: the preset name or "pattern <glob>"
    age: float = 0.0  # seconds since the newest mtime in its tree
    size: int = 0  # apparent bytes of its regular files (each inode once)
    freed: int = 0  # bytes freed (dry run / kept: the estimate)
    recovery: str | None = None  # rolled-forward | rolled-back (dry run: roll-forward | roll-back)
    is_dir: bool = True
    ino: tuple[int, int] = (0, 0)
    mtime: float = 0.0
    error: str | None = None

    def decide(self, decision: Decision, reason: str) -> None:
        self.decision, self.reason = decision, reason

    @property
    def leaked(self) -> bool:
        return self.decision in _LEAKED and self.kind != Kind.UNKNOWN

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "root": str(self.root), "kind": self.kind.value, "match": self.match,
            "owner": self.owner, "age_seconds": round(self.age, 3), "size": self.size,
            "bytes_freed": self.freed if self.decision == Decision.REMOVED else 0,
            "decision": self.decision.value, "reason": self.reason, "recovery": self.recovery,
            "error": self.error,
        }


@dataclass
class GcProblem:
    path: str
    message: str
    hint: str | None = None  # what to do about it, where it is not "fix the permissions"

    def to_dict(self) -> dict[str, str]:
        out = {"path": self.path, "message": self.message}
        if self.hint:
            out["hint"] = self.hint
        return out


@dataclass
class GcResult:
    roots: list[Path]
    options: GcOptions
    candidates: list[Candidate] = field(default_factory=list)
    problems: list[GcProblem] = field(default_factory=list)
    scanned: int = 0  # directory entries looked at
    seconds: float = 0.0

    def count(self, decision: Decision) -> int:
        return sum(1 for c in self.candidates if c.decision == decision)

    @property
    def removed(self) -> list[Candidate]:
        return [c for c in self.candidates if c.decision == Decision.REMOVED]

    @property
    def bytes_freed(self) -> int:
        return sum(c.freed for c in self.removed)

    @property
    def bytes_to_free(self) -> int:
        return sum(c.freed for c in self.candidates if c.decision == Decision.WOULD_REMOVE)

    @property
    def leaked(self) -> list[Candidate]:
        return [c for c in self.candidates if c.leaked]

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "roots": [str(r) for r in self.roots],
            "dry_run": o.dry_run,
            "options": {"older_than_seconds": o.older_than, "min_age_seconds": o.min_age,
                        "max_depth": o.max_depth, "presets": list(o.presets), "patterns": list(o.patterns)},
            "entries_scanned": self.scanned,
            "seconds": round(self.seconds, 3),
            "candidates": [c.to_dict() for c in self.candidates],
            "removed": len(self.removed),
            "would_remove": self.count(Decision.WOULD_REMOVE),
            "kept": self.count(Decision.KEPT),
            "deferred": self.count(Decision.DEFERRED),
            "leaked": len(self.leaked),
            "bytes_freed": self.bytes_freed,
            "bytes_to_free": self.bytes_to_free,
            "errors": [p.to_dict() for p in self.problems],
        }


Progress = Callable[[str], None]
