"""Findings: what a check found, with a stable dotted code, a severity and a hint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITY_RANK = {INFO: 0, WARNING: 1, ERROR: 2}


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    path: str
    message: str
    hint: str | None = None
    tensor: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "code": self.code,
            "severity": self.severity,
            "path": self.path,
            "message": self.message,
            "hint": self.hint,
        }
        if self.tensor is not None:
            out["tensor"] = self.tensor
        if self.details:
            out["details"] = self.details
        return out


def worst(findings: list[Finding]) -> str | None:
    """The highest severity among findings, or None."""
    best: str | None = None
    for f in findings:
        if best is None or SEVERITY_RANK[f.severity] > SEVERITY_RANK[best]:
            best = f.severity
    return best


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == ERROR for f in findings)
