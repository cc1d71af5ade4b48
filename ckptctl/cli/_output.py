"""The only place that prints. One Output object per command invocation.

stdout carries data only (tables for people, or exactly one JSON document with ``--json``);
logs, progress, warnings, errors and hints go to stderr. Colour and interactivity are decided
once from the environment (``NO_COLOR``, ``TERM=dumb``, ``CI``) and consoles are created lazily so
they bind to the streams in effect at call time (``CliRunner`` swaps them).
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    from rich.console import Console

import typer

from ckptctl._version import SCHEMA_VERSION, __version__
from ckptctl.errors import EXIT_BROKEN_PIPE, CkptctlError, Interrupted


# SIGTERM (kill, systemd, Kubernetes) and SIGHUP (a closed terminal or ssh session) are handled like
# Ctrl-C: the first one raises KeyboardInterrupt where the program is, so every cleanup path of
# Ctrl-C runs; later ones are only recorded (they must not interrupt that cleanup). The exit code
# is 128 + the signal number (143, 129), after one error line / one JSON document.
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Signals:
    """Which handled signal arrived first (None: none, or Ctrl-C)."""

    received: int | None = None

    @classmethod
    def handler(cls, signum: int, _frame: Any) -> None:
        if cls.received is None:
            cls.received = signum
            raise KeyboardInterrupt

    @classmethod
    @contextmanager
    def handled(cls) -> Iterator[None]:
        """Install the handler (main thread only) for the block; restore the previous ones after."""
        previous = {s: signal.signal(s, cls.handler) for s in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    @classmethod
    def interruption(cls, exc: Interrupted) -> Interrupted:
        """``exc``, naming the handled signal that caused it (and its exit code), if one did."""
        if cls.received is not None:
            return exc.by_signal(cls.received, signal.Signals(cls.received).name)
        return exc


def human_size(n: int) -> str:
    """A byte count for people: decimal units, as the sizes on the command line (1.23 GB)."""
    from rich import filesize

    return filesize.decimal(n, precision=2)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 error``, ``2 errors``, ``1,000 leftovers`` (``many``: an irregular plural)."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


NAMES_SHOWN = 8  # names listed on one summary line; --json has them all


def names_line(what: str, names: Sequence[str]) -> str:
    """``removed from the old version: a, b, c`` for a few names, the first ``NAMES_SHOWN`` and a
    count for many (1,000 removed shards are one short line, not 35 kB)."""
    shown = ", ".join(names[:NAMES_SHOWN])
    more = len(names) - NAMES_SHOWN
    return f"{what}: {shown}" + (f" and {more:,} more (--json lists them all)" if more > 0 else "")


_PIPE_WIDTH = 100_000
_ROWS_AT_ONCE = 4096
# the bytes of a string's UTF-8 text that json's encoder (ensure_ascii=False) writes as they are:
# all but a quote, a backslash and the control characters; a name of them only is its own text
_JSON_PLAIN_BYTES = bytes(b for b in range(256) if b >= 0x20 and b not in b'"\\')


def _maybe_terminal() -> bool:
    """Whether rich could take stdout for a terminal: a tty, or an environment that makes rich say
    so (``TTY_COMPATIBLE=1``, ``FORCE_COLOR``). Off it, a line of text is written without rich."""
    if os.environ.get("TTY_COMPATIBLE") == "1" or os.environ.get("FORCE_COLOR"):
        return True
    try:
        return sys.stdout.isatty()
    except ValueError:  # a closed stdout
        return False


class JsonRows:
    """An array of objects ``{"name": names[i], **fields[codes[i]]}`` under ``key``, by column:
    rows share their ``fields`` objects (one per distinct code)."""

    __slots__ = ("key", "names", "codes", "fields")

    def __init__(self, key: str, names: Sequence[str], codes: Sequence[int],
                 fields: Mapping[int, dict[str, Any]]) -> None:
        self.key, self.names, self.codes, self.fields = key, names, codes, fields


class _Tails(dict):  # type: ignore[type-arg]
    """A code's object text after the name (``, "dtype": ...}``), encoded on first use."""

    def __init__(self, fields: Mapping[int, dict[str, Any]]) -> None:
        super().__init__()
        self._fields = fields

    def __missing__(self, code: int) -> str:
        f = self._fields[code]
        tail = self[code] = ", " + json.dumps(f, ensure_ascii=False, default=str)[1:] if f else "}"
        return tail


def _plain(joined: str, k: int) -> bool:
    """Whether none of the ``k`` names joined by newlines in ``joined`` needs an escape in JSON:
    their UTF-8 text holds no byte but :data:`_JSON_PLAIN_BYTES` and the k - 1 newlines (a C
    pass, about ten times a regular expression's search)."""
    try:
        return len(joined.encode("utf-8").translate(None, _JSON_PLAIN_BYTES)) == k - 1
    except UnicodeEncodeError:  # a lone surrogate: json's encoder decides
        return False


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
            from rich.console import Console

            self._out = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=False)
            if not self._out.is_terminal:
                # stdout carries data: in a pipe or file, never wrap or truncate a tensor name or
                # path to fit 80 columns (rich's default width off a terminal).
                self._out.width = _PIPE_WIDTH
        return self._out

    @property
    def err(self) -> Console:
        if self._err is None:
            from rich.console import Console

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

    def note(self, message: str) -> None:
        """Something true the user may want to act on, not a problem (a padded vocabulary kept)."""
        if self.verbosity >= 0:
            self.err.print(f"note: {message}", style="cyan")

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

    def emit_json(self, doc: dict[str, Any], *, rows: "JsonRows | None" = None) -> None:
        """Write ``doc`` as one line (scripts read it, and only the compact form uses json's C
        encoder). ``rows`` (:class:`JsonRows`) ends the document with an array of objects
        ``{"name": name, **fields}``, written ``_ROWS_AT_ONCE`` at a time: the bytes ``json.dumps``
        gives for the whole document, never held as one string. Each distinct ``fields`` object
        (rows share them) is encoded once; a chunk's names that hold nothing JSON escapes are
        written as they are, between the quotes of the texts around them (one ``str.join`` of
        the chunk's pieces, no string made per row)."""
        text = json.dumps(doc, ensure_ascii=False, default=str)
        if rows is None:
            self.write(text + "\n")
            return
        self.write(f"{text[:-1]}{', ' if doc else ''}{json.dumps(rows.key, ensure_ascii=False)}: [")
        tails = _Tails(rows.fields)
        names, codes = rows.names, rows.codes
        for a in range(0, len(names), _ROWS_AT_ONCE):
            chunk = names[a:a + _ROWS_AT_ONCE]
            k = len(chunk)
            if _plain("\n".join(chunk), k):
                quote = '"'  # each name as it is, quoted by the pieces around it
            else:
                chunk, quote = list(map(json.encoder.encode_basestring, chunk)), ""
            pieces: list[str] = [""] * (4 * k)
            pieces[0::4] = [', {"name": ' + quote] * k
            if a == 0:
                pieces[0] = '{"name": ' + quote
            pieces[1::4] = chunk
            pieces[2::4] = [quote] * k
            pieces[3::4] = list(map(tails.__getitem__, codes[a:a + _ROWS_AT_ONCE]))
            self.write("".join(pieces))
        self.write("]}\n")

    @staticmethod
    def write(text: str) -> None:
        """Write data to stdout. When its reader went away (``ckptctl inspect DIR | head -1``),
        nothing more can be said there: stdout is pointed at /dev/null (so the interpreter's last
        flush is silent) and the command exits 141 (128 + SIGPIPE), quietly, as the shell reports
        a writer whose reader left."""
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            raise typer.Exit(EXIT_BROKEN_PIPE) from None

    @property
    def color(self) -> bool:
        """Colour on stdout: a terminal, and neither ``NO_COLOR`` nor ``TERM=dumb`` (rich's reading)."""
        return self.out.is_terminal and not self.out.no_color and self.out.color_system is not None

    def print(self, renderable: Any = "") -> None:
        """Data for people on stdout: the command's result, also with ``-q`` (which silences
        stderr only). Off a terminal each line is written without its trailing padding (rich pads
        table cells and titles to the table's width)."""
        if isinstance(renderable, str) and not _maybe_terminal():  # a line of text: rich is not needed
            text = renderable + "\n"
        elif self.out.is_terminal:
            self.out.print(renderable)
            return
        else:
            from rich.console import Console

            page = Console(file=io.StringIO(), width=_PIPE_WIDTH, markup=False, highlight=False, soft_wrap=False,
                           color_system=self.out.color_system, no_color=self.out.no_color)
            page.print(renderable)
            text = page.file.getvalue()  # type: ignore[attr-defined]
        self.write("\n".join(line.rstrip() for line in text.split("\n")))

    def table(self, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> None:
        """A result table on stdout (:mod:`ckptctl.cli._table`): ``columns`` as (header, "left" or
        "right"), ``rows`` of text cells."""
        from ckptctl.cli import _table
        from ckptctl.fastpaths import enabled

        text = _table.ruled(columns, rows) if enabled("table") and not _maybe_terminal() else None
        if text is None:
            self.print(_table.rich_table(columns, rows))
        else:
            self.write(text)

    # error handling -------------------------------------------------------------------------
    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn expected failures into one line + hint and an exit code; Ctrl-C into 130."""
        try:
            yield
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            self.fail(Signals.interruption(Interrupted("interrupted; cleanup done, nothing was published",
                                                        "run the command again to start over")))
        except CkptctlError as exc:
            if os.environ.get("CKPTCTL_DEBUG"):
                traceback.print_exc(file=sys.stderr)
            self.fail(Signals.interruption(exc) if isinstance(exc, Interrupted) else exc)

    def fail(self, exc: CkptctlError) -> None:
        """Report ``exc`` (one line + hint on stderr; one JSON document with ``--json``) and raise
        ``typer.Exit`` with its exit code."""
        if self.json_mode:
            self.emit_json(self.document(False, error=exc.to_dict()))
        self.error(str(exc), exc.hint)
        raise typer.Exit(exc.exit_code)


class ProgressReporter:
    """Renders the core's ProgressEvents: a rich bar on an interactive stderr, one plain line per
    shard otherwise, nothing with -q or --json. On a terminal a status line comes first
    (:meth:`start`: reading and planning; ``waiting`` once the plan is made, until the first byte
    is written, e.g. while a converter is imported); the rate and time-left clock starts at the
    first byte written, so that wait is not counted in them. The bar is redrawn on each event."""

    def __init__(self, out: Output, waiting: str = "preparing the write") -> None:
        self.out = out
        self.enabled = out.verbosity >= 0
        self.rich = self.enabled and out.interactive
        self.waiting = waiting
        self._progress: Any = None
        self._task: Any = None
        self._writing = False  # the first byte was written: the clock runs

    def start(self, status: str = "reading the source and planning") -> None:
        """The status line before the first event (a terminal only)."""
        if self.rich and self._progress is None:
            self._open(status, None)

    def __call__(self, event: Any) -> None:
        if not self.enabled:
            return
        if self.rich:
            self._rich(event)
        elif event.phase == "shard-done":
            self.out.err.print(f"{event.message or 'wrote'} {event.file} ({event.done:,}/{event.total:,} bytes)")
        elif event.phase == "publish":
            self.out.err.print("publishing")

    def _open(self, description: str, total: int | None) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeRemainingColumn(), console=self.out.err,
                                  transient=True, auto_refresh=False)
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, start=False)  # no clock yet
        self._progress.refresh()

    def _rich(self, event: Any) -> None:
        if event.phase == "plan":
            if self._progress is None:
                self._open(self.waiting, max(event.total, 1))
            else:
                self._progress.update(self._task, total=max(event.total, 1), description=self.waiting)
        elif self._progress is None:
            return
        elif event.phase == "write":
            if not self._writing:  # the first byte: the rate and time left are measured from here
                self._writing = True
                self._progress.reset(self._task, start=True, completed=event.done,
                                     description=event.file or "writing")
            else:
                self._progress.update(self._task, completed=event.done, description=event.file or "writing")
        elif event.phase in ("finalize", "publish", "done"):
            self._progress.update(self._task, description="finishing" if event.phase == "finalize" else event.phase)
            if event.phase == "done":
                self.close()
                return
        self._progress.refresh()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
