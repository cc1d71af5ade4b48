"""`ckptctl verify PATH...`.

No ``from __future__ import annotations`` in command modules: Typer evaluates every string
annotation of a command twice when it builds the command (``inspect.signature(eval_str=True)``
and ``get_type_hints``), on every run; real annotations are built once, at import."""

import os
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ckptctl.cli._options import JsonOpt, QuietOpt, VerboseOpt
from ckptctl.cli._output import Output, human_size
from ckptctl.errors import EXIT_FINDINGS, EXIT_OK, EXIT_OPERATIONAL, UsageError

if TYPE_CHECKING:
    from ckptctl.verify import Report

MAX_ROWS_PER_CODE = 20  # per (code, file) in the table; --json always has every finding


class FailOn(str, Enum):
    error = "error"
    warning = "warning"


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
        help="Exit 1 when a finding of this severity or worse exists.")] = FailOn.error,
    base: Annotated[Optional[str], typer.Option(
        "--base", help="Base model (directory or cached repo id) to check an adapter against "
        "(default: its base_model_name_or_path, when available locally).")] = None,
    static: Annotated[bool, typer.Option(
        "--static", help="Static rules only: do not build the model class with its library (no torch or "
        "transformers/diffusers import).")] = False,
    max_shard_size: Annotated[Optional[str], typer.Option(
        "--max-shard-size", help="Warn about shards holding more tensor bytes than this (5GB, 2GiB).")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = 0,
    verbose: VerboseOpt = 0,
) -> None:
    """Check checkpoints without loading them: headers, index, shards, config, adapter, manifest,
    and the model class its library builds on the meta device (unless --static).

    Exit 0 when clean, 1 when a finding reaches --fail-on, 2 on usage errors, 3 on I/O errors.
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
        level = fail_on.value
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
            _render(out, report, level, always=code != EXIT_OK)
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


def _render(out: Output, report: "Report", level: str, *, always: bool) -> None:
    """The findings tables on stdout (with -q only when the verdict is not OK)."""
    if out.verbosity < 0 and not always:
        return  # Output.print would print nothing: no table is built (nor rich.table imported)
    from rich.table import Table  # here: not on --help's import path

    show_info = out.verbosity >= 1
    if len(report.results) > 1:
        summary = Table(title="checkpoints", title_justify="left")
        for col in ("path", "kind", "errors", "warnings", "verdict"):
            summary.add_column(col, justify="right" if col in ("errors", "warnings") else "left",
                               overflow="fold")
        for r in report.results:
            c = r.counts()
            verdict = "io-error" if r.io_error else ("fail" if r.failed(level) else "ok")
            summary.add_row(r.path, r.kind, str(c["error"]), str(c["warning"]), verdict)
        out.print(summary, always=always)
    for r in report.results:
        rows = [f for f in r.findings if show_info or f.severity != "info"]
        if not rows:
            continue
        table = Table(title=r.path, title_justify="left")
        for col in ("code", "severity", "file", "tensor", "message", "hint"):
            table.add_column(col, overflow="fold")
        seen: dict[tuple[str, str], int] = {}
        for f in rows:
            key = (f.code, f.path)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= MAX_ROWS_PER_CODE:
                table.add_row(f.code, f.severity, _shown_file(f.path, r.root), f.tensor or "", f.message, f.hint or "")
        for (code, path), n in seen.items():
            if n > MAX_ROWS_PER_CODE:
                table.add_row(code, "", _shown_file(path, r.root), "",
                              f"... and {n - MAX_ROWS_PER_CODE} more {code} findings (see --json)", "")
        out.print(table, always=always)


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
    counts = f"{c['error']} errors, {c['warning']} warnings, {c['info']} notes"
    what = f"{n} checkpoint{'s' if n != 1 else ''}"
    if code == EXIT_OPERATIONAL:
        out.err.print(f"verify: I/O ERROR: could not read everything in {what} ({counts})", style="bold red")
    elif code == EXIT_FINDINGS:
        out.err.print(f"verify: FAIL: {failed} of {what} with findings at or above {level} ({counts})",
                      style="bold red")
    else:
        out.err.print(f"verify: OK: {what} ({counts}; fail-on {level})", style="green")
