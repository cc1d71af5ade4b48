"""Shared option aliases for every command (Typer's Annotated style)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl.sources.kinds import SHAPES, only_help

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
QuietOpt = Annotated[int, typer.Option("--quiet", "-q", count=True, help="Less output on stderr (no progress).")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More output on stderr.")]
KeyOpt = Annotated[Optional[str], typer.Option(
    "--key", help="For training checkpoints: the key that holds the state dict (e.g. model, state_dict).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show the plan and change nothing.")]
# --only: every source kind (sources/kinds.py), in probe order, then the layout's shapes.
ONLY_HELP = only_help(*SHAPES)


# Validated by the core (a UsageError inside Output.guard), so --json still gets its document.
DtypeOpt = Annotated[str, typer.Option("--dtype",
                                       help="keep, bf16, fp16 or fp32 (floating tensors only; config.json follows).")]
ManifestOpt = Annotated[bool, typer.Option("--manifest", help="Write ckptctl.manifest.json (every file's size and sha256).")]
LabelOpt = Annotated[Optional[str], typer.Option("--label", help="A label recorded in the manifest, e.g. the training step.")]
NoFsyncOpt = Annotated[bool, typer.Option("--no-fsync", help="Skip fsync (scratch output only: not crash-safe).")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", metavar="SECONDS",
    help="Under torchrun: how long a rank waits for the others (to join, and at each step) before failing "
         "with the ranks that did not come.")]
