"""Shared option aliases for every command (Typer's Annotated style)."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
QuietOpt = Annotated[int, typer.Option("--quiet", "-q", count=True, help="Less output on stderr (no progress).")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More output on stderr.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show the plan and change nothing.")]
