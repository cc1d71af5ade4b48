"""`ckptctl verify PATH...`.

No ``from __future__ import annotations`` in command modules: Typer evaluates every string
annotation of a command twice when it builds the command (``inspect.signature(eval_str=True)``
and ``get_type_hints``), on every run; real annotations are built once, at import."""

import os
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ckptctl.cli._options import JsonOpt, QuietOpt, VerboseOpt, choices
from ckptctl.cli._output import Output, human_size, plural
from ckptctl.errors import EXIT_FINDINGS, EXIT_OK, EXIT_OPERATIONAL, UsageError

if TYPE_CHECKING:
    from ckptctl.verify import Report

MAX_ROWS_PER_CODE = 20  # per (code, file) in the table; --json always has every finding


FailOn = choices(("error", "warning"))


def verify(
    paths: Annotated[Optional[list[str]], typer.Argument(
        help="Checkpoint directories, weights files (.safetensors, .bin), or repo ids in the local HF cache.",
        metavar="PATH...", show_default=False)] = None,
    recursive: Annotated[bool, typer.Option(
        "--recursive", "-r", help="Treat each PATH as a root and verify every checkpoint below it.")] = False,
    deep: Annotated[bool, typer.Option(
        "--deep",
        help="Read every byte: sha256 (checked against the manifest), NaN/Inf and all-zero tensors.")] = False,
    fail_on: Annotated[FailOn, typer.Option(
        "--fail-on", case_sensitive=False,
        help="Exit 1 when a finding of this severity or worse exists.")] = "error",
    base: Annotated[Optional[str], typer.Option(
        "--base", metavar="MODEL", help="Base model (directory or cached repo id) to check an adapter against "
        "(default: its base_model_name_or_path, when available locally).")] = None,
    static: Annotated[bool, typer.Option(
        "--static", help="Static rules only: do not build the model class with its library (no torch or "
        "transformers/diffusers import).")] = False,
    max_shard_size: Annotated[Optional[str], typer.Option(
        "--max-shard-size", metavar="SIZE", help="Warn about shards holding more tensor bytes than this (5GB, 2GiB).")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = 0,
    verbose: VerboseOpt = 0,
) -> None:
    """Check checkpoints without loading them: headers, index, shards, config, adapter, manifest,
    and the model class its library builds on the meta device (unless --static).

    Exit 0 when clean, 1 when a finding reaches --fail-on, 2 on usage errors, 3 on I/O errors.
    One line per finding (path: severity code: message, then its hint); -v for tables.

    Examples:

    \b
      ckptctl verify ./hf
      ckptctl verify --static ./hf                 # no torch or transformers import
      ckptctl verify --deep --fail-on warning ./hf
      ckptctl verify -r /data/checkpoints --json
    """
    out = Output("verify", json_mode=json_, quiet=quiet, verbose=verbose)
    code = EXIT_OK
    with out.guard():
        from ckptctl.sizes import parse_size
        from ckptctl.verify import VerifyOptions, verify_paths

        limit = None
        if max_shard_size is not None:
            try:
                limit = parse_size(max_shard_size)
            except ValueError as exc:
                raise UsageError(f"--max-shard-size: {exc}", "use a size like 5GB or 2GiB") from None
        level = fail_on
        progress = _Progress(out, deep)
        try:
            report = verify_paths(list(paths or []), recursive=recursive,
                                  options=VerifyOptions(deep=deep, base=base, max_shard_size=limit, static=static),
                                  progress=progress)
        finally:
            progress.close()
        if report.io_error:
            code = EXIT_OPERATIONAL
        elif report.failed(level):
            code = EXIT_FINDINGS
        if json_:
            out.emit_json(out.document(code == EXIT_OK, **report.to_dict(level)))
        else:
            _render(out, report, level)
            _checks(out, report)
        _verdict(out, report, level, code)
    raise typer.Exit(code)


class _Progress:
    """Progress on stderr: a byte bar for --deep on a terminal, else one plain line per file."""

    def __init__(self, out: Output, deep: bool) -> None:
        self.out = out
        self.deep = deep
        self.bar: Any = None
        self.tasks: dict[str, Any] = {}

    def __call__(self, event: str, path: str, amount: int) -> None:
        out = self.out
        if out.verbosity < 0:
            return
        if event == "path":
            out.debug(f"verifying {path}")
            return
        if not self.deep:
            return
        if out.interactive:
            if self.bar is None:
                from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                           TransferSpeedColumn)

                self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                    TransferSpeedColumn(), TimeRemainingColumn(), console=out.err, transient=True)
                self.bar.start()
            if event == "file":
                self.tasks[path] = self.bar.add_task(os.path.basename(path), total=amount or None)
            elif event == "bytes" and path in self.tasks:
                self.bar.advance(self.tasks[path], amount)
            elif event == "done" and path in self.tasks:
                self.bar.remove_task(self.tasks.pop(path))
        elif event == "file":
            out.info(f"reading {path} ({human_size(amount)})")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _shown_file(path: str, root: str) -> str:
    try:
        if os.path.commonpath([os.path.abspath(path), os.path.abspath(root)]) == os.path.abspath(root):
            rel = os.path.relpath(path, root)
            return "." if rel == "." else rel
    except ValueError:
        pass
    return path


def _render(out: Output, report: "Report", level: str) -> None:
    """The findings on stdout, also with -q: one line each, ``path: severity code: message``, and an
    indented ``hint:`` (grep-able, whole at any width); with -v the notes too, and the tables."""
    show_info = out.verbosity >= 1
    if show_info:  # -v: the tables, with the notes
        if len(report.results) > 1:
            out.print(_summary_table(report, level))
        for r in report.results:
            if r.findings:
                out.print(_findings_table(r, r.findings))
        return
    for r in report.results:
        seen: dict[tuple[str, str], int] = {}
        for f in r.findings:
            if f.severity == "info":
                continue
            key = (f.code, f.path)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= MAX_ROWS_PER_CODE:
                out.print(finding_line(f, r.root, color=out.color))
                if f.hint:
                    out.print(_indented(f"hint: {f.hint}"))
        for (code, path), n in seen.items():
            if n > MAX_ROWS_PER_CODE:
                out.print(f"{path}: ... and {n - MAX_ROWS_PER_CODE} more {code} findings (see --json)")


def _indented(text: str) -> Any:
    """``text`` four columns in, wrapped lines too (on a terminal)."""
    from rich.padding import Padding

    return Padding(text, (0, 0, 0, 4))


SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def finding_message(message: str, path: str, root: str) -> str:
    """A finding's message without the path its line starts with: a message that opens with the
    finding's own file drops it; one that opens with another file of the checkpoint (the index
    that maps a tensor to this shard) keeps that file's name only."""
    for lead in sorted({path, root}, key=len, reverse=True):
        if lead and message.startswith(lead) and message[len(lead):len(lead) + 1] in (":", " ", "/"):
            rest = message[len(lead):]
            if lead == path and rest[:1] in (":", " "):
                return rest.lstrip(": ") or message
            if rest.startswith("/"):
                return rest[1:]
    return message


def finding_line(f: Any, root: str, *, color: bool) -> Any:
    """``path: severity code: message`` (the severity styled when ``color``), ``(tensor T)`` added
    when the message does not name the tensor."""
    from rich.text import Text

    message = finding_message(f.message, f.path, root)
    if f.tensor and f.tensor not in message:
        message += f" (tensor {f.tensor})"
    return Text.assemble(f"{f.path}: ", (f.severity, SEVERITY_STYLE.get(f.severity, "") if color else ""),
                         f" {f.code}: {message}")


def _summary_table(report: "Report", level: str) -> Any:
    from rich.table import Table  # here: not on --help's import path

    summary = Table(title="checkpoints", title_justify="left")
    for col in ("path", "kind", "errors", "warnings", "verdict"):
        summary.add_column(col, justify="right" if col in ("errors", "warnings") else "left", overflow="fold")
    for r in report.results:
        c = r.counts()
        verdict = "io-error" if r.io_error else ("fail" if r.failed(level) else "ok")
        summary.add_row(r.path, r.kind, str(c["error"]), str(c["warning"]), verdict)
    return summary


def _findings_table(r: Any, rows: list) -> Any:
    """-v: a checkpoint's findings as a table (file relative to its root, the tensor a column)."""
    from rich.table import Table

    table = Table(title=r.path, title_justify="left", title_style="bold")
    for col in ("code", "severity", "file", "tensor", "message", "hint"):
        table.add_column(col, overflow="fold", no_wrap=col == "code")
    seen: dict[tuple[str, str], int] = {}
    for f in rows:
        key = (f.code, f.path)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= MAX_ROWS_PER_CODE:
            table.add_row(f.code, f.severity, _shown_file(f.path, r.root), f.tensor or "",
                          finding_message(f.message, f.path, r.root), f.hint or "")
    for (code, path), n in seen.items():
        if n > MAX_ROWS_PER_CODE:
            table.add_row(code, "", _shown_file(path, r.root), "",
                          f"... and {n - MAX_ROWS_PER_CODE} more {code} findings (see --json)", "")
    return table


def _checks(out: Output, report: "Report") -> None:
    """One line per path on stderr: the check groups that ran, and those that did not and why."""
    for r in report.results:
        skipped = ", ".join(f"{g} ({why})" for g, why in r.checks.skipped.items())
        out.info(f"checks of {r.path}: ran {', '.join(r.checks.ran) or 'none'}; not run: {skipped or 'none'}")


def _verdict(out: Output, report: "Report", level: str, code: int) -> None:
    if out.verbosity < 0:
        return
    c = report.counts()
    n = len(report.results)
    failed = sum(1 for r in report.results if r.failed(level) or r.io_error)
    counts = f"{plural(c['error'], 'error')}, {plural(c['warning'], 'warning')}, {plural(c['info'], 'note')}"
    what = plural(n, "checkpoint")
    if code == EXIT_OPERATIONAL:
        out.err.print(f"verify: I/O ERROR: could not read everything in {what} ({counts})", style="bold red")
    elif code == EXIT_FINDINGS:
        out.err.print(f"verify: FAIL: {failed} of {what} with findings at or above {level} ({counts})",
                      style="bold red")
    else:
        out.err.print(f"verify: OK: {what} ({counts}; fail-on {level})", style="green")
