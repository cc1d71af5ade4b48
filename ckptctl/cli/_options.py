"""Shared option aliases for every command (Typer's Annotated style)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Optional

import typer

from ckptctl.format.dtypes import TARGETS
from ckptctl.format.names import PRESETS
from ckptctl.sources.kinds import NAMES_CHOICES, ONLY_CHOICES, SHAPES, only_help


def choices(values: tuple[str, ...] | list[str]) -> Any:
    """A choice type for Typer from one list of values (shown in help, completed by every shell,
    refused with the house usage error otherwise). A ``Literal`` of the values: Typer hands the
    command the value itself, a plain ``str`` (a ``StrEnum`` made the same choice 0.1-0.2 ms
    slower per type, at every command's start)."""
    return Literal[tuple(values)]


def repeatable_choices(name: str, values: tuple[str, ...]) -> type[StrEnum]:
    """The choice type of a repeatable option (``List[...]``), which Typer takes only as an enum
    class: a ``StrEnum`` whose values are the choices (the command reads ``.value``)."""
    return StrEnum(name, {v: v for v in values})  # type: ignore[return-value]


# Each from its one list: the dtypes --dtype converts to (format/dtypes.py), the source kinds of the
# registry and the layout's shapes (sources/kinds.py ONLY_CHOICES), the name sets, gc-tmp's presets.
Dtype = choices(("keep", *TARGETS))
Only = choices(ONLY_CHOICES)
NameSet = choices(NAMES_CHOICES)
Preset = repeatable_choices("Preset", tuple(PRESETS))

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
QuietOpt = Annotated[int, typer.Option("--quiet", "-q", count=True, show_default=False,
                                       help="Nothing on stderr but errors (no progress, no summaries); the result stays on stdout.")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True, show_default=False,
                                         help="More output on stderr (and verify's findings as tables).")]
KeyOpt = Annotated[Optional[str], typer.Option(
    "--key", metavar="KEY", help="For training checkpoints: the key that holds the state dict (e.g. model, state_dict).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show the plan and change nothing.")]
# --only: every source kind (sources/kinds.py), in probe order, then the layout's shapes.
ONLY_HELP = only_help(*SHAPES)


OnlyOpt = Annotated[Optional[Only], typer.Option("--only", help=ONLY_HELP, show_default=False)]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype",
                                         help="Store floating tensors as this dtype (config.json follows).")]
ManifestOpt = Annotated[bool, typer.Option("--manifest", help="Write ckptctl.manifest.json (every file's size and sha256).")]
LabelOpt = Annotated[Optional[str], typer.Option("--label", metavar="TEXT", help="A label recorded in the manifest, e.g. the training step.")]
NoFsyncOpt = Annotated[bool, typer.Option("--no-fsync", help="Skip fsync (scratch output only: not crash-safe).")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", metavar="SECONDS",
    help="Under torchrun: how long a rank waits for the others (to join, and at each step) before failing "
         "with the ranks that did not come.")]
