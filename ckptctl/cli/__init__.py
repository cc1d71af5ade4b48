"""The Typer application. Commands are registered here only when they work.

Each command lives in its own module, imported only when the app that holds it is built:
``ckptctl verify ...`` builds an app of the root and ``verify`` alone (Typer reads the signature
of every registered command when it runs), ``--help``, completion and anything else the full app.
``app`` is the full app (built when it is asked for).
"""

from __future__ import annotations

import atexit
import importlib
import os
import re
import sys
import threading
from typing import Annotated, Any, Callable, NoReturn, Optional

import typer

from ckptctl._version import __version__
from ckptctl.cli._output import Output, Signals
from ckptctl.fastpaths import enabled

# command name -> (module, function): the order of --help
COMMANDS: dict[str, tuple[str, str]] = {
    "export": ("ckptctl.cli.export_cmd", "export"),
    "env": ("ckptctl.cli.env_cmd", "env"),
    "gc-tmp": ("ckptctl.cli.gc_cmd", "gc_tmp"),
    "inspect": ("ckptctl.cli.inspect_cmd", "inspect"),
    "resave": ("ckptctl.cli.resave_cmd", "resave"),
    "verify": ("ckptctl.cli.verify_cmd", "verify"),
}
# Typer's completion protocol: the shell asks the full app (command names, options)
COMPLETE_VAR = "_CKPTCTL_COMPLETE"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckptctl {__version__}")
        raise typer.Exit(0)


def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """ckptctl: checkpoint export and repair."""


def command(name: str) -> Callable[..., Any]:
    """The function of command ``name`` (its module imported now)."""
    module, function = COMMANDS[name]
    return getattr(importlib.import_module(module), function)


def build(names: tuple[str, ...] = tuple(COMMANDS), *, listed_only: bool = False) -> typer.Typer:
    """The Typer app with the root options and the commands ``names``. ``listed_only``: each command
    is listed by its name and summary but takes no parameter, so Typer does not build the options
    of all six commands (about 4 ms) for a command line that runs none of them (:func:`app_for`)."""
    made = typer.Typer(
        name="ckptctl",
        help="Export, repair, verify and clean up Hugging Face-style safetensors checkpoints, atomically.",
        no_args_is_help=True,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    made.callback()(_root)
    for name in names:
        func = command(name)
        made.command(name, short_help=summary(func.__doc__))(_not_run if listed_only else func)
    return made


def _not_run() -> None:
    """The callback of a command in a ``listed_only`` app, which :func:`app_for` builds only for a
    command line that names no command."""
    raise AssertionError("a listed-only app ran a command")


def summary(doc: str | None) -> str:
    """A command's whole summary for the top-level help: its docstring's first paragraph, on one
    line (Typer would cut it at 45 characters with "...")."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def full_app() -> typer.Typer:
    """The app with every command (built at each call: nothing is kept at module level)."""
    return build()


def __getattr__(name: str) -> Any:
    if name == "app":
        return full_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def app_for(args: list[str]) -> typer.Typer:
    """The app a command line needs: the root and the command it names first; the commands listed
    only (``--help``, ``--version``, no argument) when it names none; the full app for completion
    and for a command named after a root option."""
    if COMPLETE_VAR in os.environ:
        return full_app()
    if args and args[0] in COMMANDS:
        return build((args[0],))
    if not any(arg in COMMANDS for arg in args):
        return build(listed_only=True)
    return full_app()


def main() -> None:
    """The console entry point. Typer runs the app with ``standalone_mode=False`` so that this
    function keeps the output contract for what Typer would otherwise print itself: a usage error
    (unknown option, missing argument) with ``--json`` is one JSON document too; SIGTERM/SIGHUP are
    handled like Ctrl-C (:class:`Signals`); a closed stdout is :meth:`Output.write`'s."""
    args = sys.argv[1:]
    try:
        with Signals.handled():
            code = app_for(args)(args=args, prog_name="ckptctl", standalone_mode=False)
    except typer.Abort:
        code = _interrupted(args)
    except KeyboardInterrupt:  # a signal after the command's own guard
        code = _interrupted(args)
    except typer.TyperException as exc:  # Typer's usage errors: unknown option, missing argument, ...
        code = _usage_error(exc, args)
    leave(code if isinstance(code, int) else 0)


def leave(code: int, *, fast: bool | None = None) -> NoReturn:
    """End the process with ``code``. The reference is ``sys.exit``: the exit handlers run, the
    output is flushed, and the interpreter frees every module and object before the process ends.
    The fast path (``fast``; unset: :func:`~ckptctl.fastpaths.enabled`) skips only that freeing,
    which the kernel does anyway: when nothing but this thread is left and torch was never
    imported (its own teardown is left to it), the exit handlers run, stdout and stderr are
    flushed and the process ends with ``os._exit``. Freeing a 92k-tensor command's records took
    18-60 ms of it."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if (not (enabled("exit") if fast is None else fast) or run_exit_handlers is None
            or threading.active_count() != 1 or "torch" in sys.modules):
        sys.exit(code)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (Output.write said so already), a closed stream
            pass
    os._exit(code)


def _command(args: list[str]) -> str:
    """The command named on the command line (``ckptctl`` when there is none)."""
    return next((a for a in args if a in COMMANDS), "ckptctl")


def _json_wanted(args: list[str]) -> bool:
    return "--json" in args[:args.index("--")] if "--" in args else "--json" in args


# a parameter named in Typer's messages: '--dtype', 'SRC' (quoted by Typer, bare in the house form)
_QUOTED_PARAM = re.compile(r"'(-{1,2}[A-Za-z0-9][\w-]*|[A-Z][A-Z0-9_.]*(?:\.\.\.)?)'")


def usage_message(exc: typer.TyperException) -> str:
    """Typer's usage message in the house form: ``missing argument SRC``, ``no such option: --x``
    (lower case, no quotes around a parameter's name, no trailing full stop)."""
    text = _QUOTED_PARAM.sub(r"\1", exc.format_message().strip()).rstrip(".")
    text = re.sub(r" \(Possible options: ([^)]*)\)$", r"; did you mean \1?", text)
    return text[:1].lower() + text[1:]


def _usage_error(exc: typer.TyperException, args: list[str]) -> int:
    """A usage error Typer found (unknown option, missing argument, a value not among the choices):
    ``error: missing argument SRC`` / ``hint: ckptctl export -h`` on stderr, exit 2, and one JSON
    document with ``--json``. ``ckptctl`` alone prints the help (on stderr), exit 2."""
    from ckptctl.errors import UsageError

    exit_code = getattr(exc, "exit_code", 2)
    if not args:  # no_args_is_help: the help is the message
        exc.show()
        return exit_code
    command = _command(args)
    err = UsageError(usage_message(exc), "ckptctl -h" if command == "ckptctl" else f"ckptctl {command} -h")
    err.exit_code = exit_code
    out = Output(command, json_mode=_json_wanted(args))
    try:
        out.fail(err)
    except typer.Exit as done:
        return done.exit_code
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
