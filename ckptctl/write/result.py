"""What an export (or a resave) did: :class:`ExportResult`, in a module of its own so that a command
that only reports (a repair with nothing to do) need not import the writer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ExportResult:
    """What an export (or resave) wrote, where, and how it was published."""

    dest: str
    dry_run: bool
    files: list[dict[str, Any]] = field(default_factory=list)  # written: name, size
    index: str | None = None
    tensors: int = 0
    parameters: int = 0
    total_size: int = 0
    bytes_to_write: int = 0
    space_available: int | None = None  # free bytes on the destination's filesystem at planning time
    bytes_cloned: int = 0  # blocks shared with the source (reflink): no data copied, no space used
    bytes_copied_by_kernel: int = 0
    bytes_streamed: int = 0
    header_padding: int = 0  # spaces added to headers so that tensors can be cloned
    extras: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)  # the source's other variant families, copied as they are
    linked: list[str] = field(default_factory=list)  # shards hard-linked from unchanged files
    carried: list[str] = field(default_factory=list)  # dest's non-weight files kept
    removed: list[str] = field(default_factory=list)  # dest's files the new version drops
    aliases: dict[str, str] = field(default_factory=dict)
    converted: int = 0
    publish: str | None = None
    manifest: str | None = None
    recovered: list[str] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the source says the user should know (a padded vocabulary kept)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
