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
    """One thing a check found: its stable ``code``, severity, where, what, and how to fix it."""

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


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == ERROR for f in findings)


@dataclass
class PathFindings:
    """Findings about one path, in the order they were found."""

    path: str
    findings: list[Finding] = field(default_factory=list)

    def add(self, code: str, severity: str, message: str, hint: str | None = None, tensor: str | None = None,
            **details: Any) -> None:
        self.findings.append(Finding(code, severity, self.path, message, hint, tensor, dict(details)))
