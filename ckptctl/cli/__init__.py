"""The Typer application. Commands are registered here only when they work."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl._version import __version__
from ckptctl.cli.export_cmd import export
from ckptctl.cli.gc_cmd import gc_tmp
from ckptctl.cli.inspect_cmd import inspect
from ckptctl.cli.resave_cmd import resave
from ckptctl.cli.verify_cmd import verify

app = typer.Typer(
    name="ckptctl",
    help="Export, repair, verify and clean up Hugging Face-style safetensors checkpoints, atomically.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckptctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """ckptctl: checkpoint export and repair."""


app.command("export")(export)
app.command("gc-tmp")(gc_tmp)
app.command("inspect")(inspect)
app.command("resave")(resave)
app.command("verify")(verify)


def main() -> None:
    app(prog_name="ckptctl")
