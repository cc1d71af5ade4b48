"""The Typer application. Commands are registered here only when they work."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from ckptctl._version import __version__
from ckptctl.cli._output import Output, Signals
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
    """The console entry point. Typer runs the app with ``standalone_mode=False`` so that this
    function keeps the output contract for what Typer would otherwise print itself: a usage error
    (unknown option, missing argument) with ``--json`` is one JSON document too; SIGTERM/SIGHUP are
    handled like Ctrl-C (:class:`Signals`); a closed stdout is :meth:`Output.write`'s."""
    args = sys.argv[1:]
    try:
        with Signals.handled():
            code = app(args=args, prog_name="ckptctl", standalone_mode=False)
    except typer.Abort:
        code = _interrupted(args)
    except KeyboardInterrupt:  # a signal after the command's own guard
        code = _interrupted(args)
    except typer.TyperException as exc:  # Typer's usage errors: unknown option, missing argument, ...
        code = _usage_error(exc, args)
    sys.exit(code if isinstance(code, int) else 0)


def _command(args: list[str]) -> str:
    """The command named on the command line (``ckptctl`` when there is none)."""
    names = {c.name for c in app.registered_commands}
    return next((a for a in args if a in names), "ckptctl")


def _json_wanted(args: list[str]) -> bool:
    return "--json" in args[:args.index("--")] if "--" in args else "--json" in args


def _usage_error(exc: typer.TyperException, args: list[str]) -> int:
    """One JSON document (with ``--json``) and Typer's own usage message, exit code Typer's."""
    from ckptctl.errors import UsageError

    exit_code = getattr(exc, "exit_code", 2)
    if _json_wanted(args):
        command = _command(args)
        helping = "ckptctl" if command == "ckptctl" else f"ckptctl {command}"
        err = UsageError(exc.format_message(), f"run `{helping} --help` for the options")
        err.exit_code = exit_code
        out = Output(command, json_mode=True)
        out.emit_json(out.document(False, error=err.to_dict()))
    exc.show()
    return exit_code


def _interrupted(args: list[str]) -> int:
    """Ctrl-C or a handled signal outside a command's own guard (while Typer parsed the command
    line, or after the command reported): one error line / JSON document, exit 130 or 128 + N."""
    from ckptctl.errors import Interrupted

    out = Output(_command(args), json_mode=_json_wanted(args))
    try:
        out.fail(Signals.interruption(Interrupted("interrupted; nothing was changed", "run the command again")))
    except typer.Exit as done:
        return done.exit_code
    return 130
