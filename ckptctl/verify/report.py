"""What ``verify`` returns: per-path results of findings and file records, and the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptctl._version import SCHEMA_VERSION  # noqa: F401  (the CLI's one --json schema version)
from ckptctl.findings import ERROR, INFO, SEVERITY_RANK, WARNING, Finding

IO_CODE = "io.error"


@dataclass
class FileRecord:
    """A file verify looked at: its role, size, and (``--deep``) its sha256."""

    name: str
    role: str  # weights | index | metadata | config | manifest | extra
    size: int | None = None
    sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "role": self.role, "size": self.size}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out


@dataclass
class Checks:
    """The check groups of a path: those that ran, and those that did not with the reason why
    (both in the pipeline's order, :data:`ckptctl.verify.pipeline.GROUPS`)."""

    ran: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ran": list(self.ran), "skipped": dict(self.skipped)}


def _counts(findings: list[Finding]) -> dict[str, int]:
    out = {ERROR: 0, WARNING: 0, INFO: 0}
    for f in findings:
        out[f.severity] += 1
    return out


@dataclass
class PathResult:
    """verify's result for one path: its kind, findings, files, and what was read."""

    path: str  # as the user gave it
    root: str  # the resolved file or directory
    kind: str = "none"
    findings: list[Finding] = field(default_factory=list)
    files: list[FileRecord] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0
    checks: Checks = field(default_factory=Checks)

    @property
    def io_error(self) -> bool:
        return any(f.code == IO_CODE for f in self.findings)

    def counts(self) -> dict[str, int]:
        return _counts(self.findings)

    def failed(self, fail_on: str = ERROR) -> bool:
        level = SEVERITY_RANK[fail_on]
        return any(SEVERITY_RANK[f.severity] >= level for f in self.findings)

    def to_dict(self, fail_on: str = ERROR) -> dict[str, Any]:
        return {
            "path": self.path,
            "root": self.root,
            "kind": self.kind,
            "ok": not self.failed(fail_on) and not self.io_error,
            "counts": self.counts(),
            "tensors": self.tensors,
            "bytes_read": self.bytes_read,
            "checks": self.checks.to_dict(),
            "files": [f.to_dict() for f in self.files],
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass
class Report:
    """verify's results for every path it was given."""

    results: list[PathResult]
    deep: bool = False

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def io_error(self) -> bool:
        return any(r.io_error for r in self.results)

    def failed(self, fail_on: str = ERROR) -> bool:
        return any(r.failed(fail_on) for r in self.results)

    def counts(self) -> dict[str, int]:
        return _counts(self.findings)

    def to_dict(self, fail_on: str = ERROR) -> dict[str, Any]:
        return {
            "fail_on": fail_on,
            "deep": self.deep,
            "summary": {"paths": len(self.results),
                        "failed": sum(1 for r in self.results if r.failed(fail_on) or r.io_error),
                        **self.counts()},
            "results": [r.to_dict(fail_on) for r in self.results],
        }
