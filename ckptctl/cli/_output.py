"""The only place that prints. One Output object per command invocation.

stdout carries data only (tables for people, or exactly one JSON document with ``--json``);
logs, progress, warnings, errors and hints go to stderr. Colour and interactivity are decided
once from the environment (``NO_COLOR``, ``TERM=dumb``, ``CI``) and consoles are created lazily so
they bind to the streams in effect at call time (``CliRunner`` swaps them).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import typer
from rich.console import Console

from ckptctl._version import __version__
from ckptctl.errors import CkptctlError, Interrupted

SCHEMA_VERSION = 1


def human_size(n: int) -> str:
    """A byte count for people: decimal units, as the sizes on the command line (1.23 GB)."""
    from rich import filesize

    return filesize.decimal(n, precision=2)


_PIPE_WIDTH = 100_000


class Output:
    def __init__(self, command: str, *, json_mode: bool = False, quiet: int = 0, verbose: int = 0) -> None:
        self.command = command
        self.json_mode = json_mode
        self.verbosity = verbose - quiet
        self._out: Console | None = None
        self._err: Console | None = None

    # consoles -------------------------------------------------------------------------------
    # rich decides what a terminal is (is_terminal, is_dumb_terminal) and honours NO_COLOR and
    # TERM=dumb itself; we only add that stdout off a terminal is never wrapped.
    @property
    def out(self) -> Console:
        if self._out is None:
            self._out = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=False)
            if not self._out.is_terminal:
                # stdout carries data: in a pipe or file, never wrap or truncate a tensor name or
                # path to fit 80 columns (rich's default width off a terminal).
                self._out.width = _PIPE_WIDTH
        return self._out

    @property
    def err(self) -> Console:
        if self._err is None:
            self._err = Console(file=sys.stderr, markup=False, highlight=False, soft_wrap=True)
        return self._err

    @property
    def interactive(self) -> bool:
        """Live progress: an interactive stderr, not -q, not CI."""
        return (self.verbosity >= 0 and self.err.is_terminal and not self.err.is_dumb_terminal
                and not os.environ.get("CI"))

    # messages (stderr) ----------------------------------------------------------------------
    def info(self, message: str) -> None:
        if self.verbosity >= 0:
            self.err.print(message, style="dim")

    def debug(self, message: str) -> None:
        if self.verbosity >= 1:
            self.err.print(message, style="dim")

    def warn(self, message: str) -> None:
        if self.verbosity >= 0:
            self.err.print(f"warning: {message}", style="yellow")

    def error(self, message: str, hint: str | None = None) -> None:
        self.err.print(f"error: {message}", style="bold red")
        if hint:
            self.err.print(f"hint: {hint}", style="cyan")

    # data (stdout) --------------------------------------------------------------------------
    def document(self, ok: bool, **payload: Any) -> dict[str, Any]:
        doc = {"schema_version": SCHEMA_VERSION, "command": self.command, "ok": ok,
               "tool_version": __version__}
        doc.update(payload)
        return doc

    def emit_json(self, doc: dict[str, Any]) -> None:
        # One line: scripts read it, and only the compact form uses json's C encoder.
        sys.stdout.write(json.dumps(doc, ensure_ascii=False, default=str) + "\n")
        sys.stdout.flush()

    def print(self, renderable: Any = "") -> None:
        self.out.print(renderable)

    # error handling -------------------------------------------------------------------------
    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn expected failures into one line + hint and an exit code; Ctrl-C into 130."""
        try:
            yield
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            self._fail(Interrupted("interrupted; cleanup done, nothing was published",
                                   "run the command again to start over"))
        except CkptctlError as exc:
            if os.environ.get("CKPTCTL_DEBUG"):
                traceback.print_exc(file=sys.stderr)
            self._fail(exc)

    def _fail(self, exc: CkptctlError) -> None:
        if self.json_mode:
            self.emit_json(self.document(False, error=exc.to_dict()))
        self.error(str(exc), exc.hint)
        raise typer.Exit(exc.exit_code)


class ProgressReporter:
    """Renders the core's ProgressEvents: a rich bar on an interactive stderr, one plain line per
    shard otherwise, nothing with -q or --json."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.enabled = out.verbosity >= 0
        self.rich = self.enabled and out.interactive
        self._progress: Any = None
        self._task: Any = None

    def __call__(self, event: Any) -> None:
        if not self.enabled:
            return
        if self.rich:
            self._rich(event)
        elif event.phase == "shard-done":
            self.out.err.print(f"{event.message or 'wrote'} {event.file} ({event.done:,}/{event.total:,} bytes)")
        elif event.phase == "publish":
            self.out.err.print("publishing")

    def _rich(self, event: Any) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        if event.phase == "plan":
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=self.out.err,
                                      transient=True)
            self._progress.start()
            self._task = self._progress.add_task("writing", total=max(event.total, 1))
        elif self._progress is None:
            return
        elif event.phase == "write":
            self._progress.update(self._task, completed=event.done, description=event.file or "writing")
        elif event.phase in ("publish", "done"):
            self._progress.update(self._task, description=event.phase)
            if event.phase == "done":
                self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
