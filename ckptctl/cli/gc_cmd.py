"""`ckptctl gc-tmp ROOT...`: remove what dead writers left behind (never a live writer's work).

No ``from __future__ import annotations``: see :mod:`ckptctl.cli.verify_cmd`."""

from typing import Annotated, List, Optional

import typer

from ckptctl.cli._options import DryRunOpt, JsonOpt, Preset, QuietOpt, VerboseOpt
from ckptctl.cli._output import Output, human_size, plural
from ckptctl.errors import EXIT_FINDINGS, EXIT_OPERATIONAL, Interrupted, UsageError

_PRESETS_HELP = "see docs/GC_TMP.md; repeatable"


def gc_tmp(
    roots: Annotated[List[str], typer.Argument(metavar="ROOT...", help="Directories to clean up below (never / or your home directory).", show_default=False)],
    older_than: Annotated[str, typer.Option("--older-than", metavar="AGE", help="Age after which foreign leftovers, and staging of writers on other hosts whose lock is free, go: 30m, 6h, 2d.")] = "1h",
    min_age: Annotated[str, typer.Option("--min-age", metavar="AGE", help="Nothing modified more recently than this is removed, even a dead writer's staging.")] = "60s",
    max_depth: Annotated[int, typer.Option("--max-depth", metavar="N", help="How deep below each root to look (1 = the root's own entries).")] = 4,
    pattern: Annotated[Optional[List[str]], typer.Option("--pattern", metavar="GLOB", help="Also remove entries whose name matches this glob, judged by age only; repeatable.")] = None,
    preset: Annotated[Optional[List[Preset]], typer.Option("--preset", help=f"Also remove what another tool leaks, judged by age only: {_PRESETS_HELP}.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Remove nothing; exit 1 when anything leaked (for monitoring).")] = False,
    dry_run: DryRunOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = 0,
    verbose: VerboseOpt = 0,
) -> None:
    """Remove staging directories of dead ckptctl writers (rolling half-done publishes forward or
    back first) and, opt-in, other tools' leftovers. A live writer's directory is never removed.

    Examples:

    \b
      ckptctl gc-tmp /data/checkpoints --dry-run
      ckptctl gc-tmp /data/checkpoints --older-than 6h --preset incomplete -q    # cron
      ckptctl gc-tmp /data/checkpoints --check --json                           # monitoring
    """
    out = Output("gc-tmp", json_mode=json_, quiet=quiet + (1 if json_ else 0), verbose=verbose)
    with out.guard():
        from ckptctl import gc
        from ckptctl.sizes import parse_duration

        opts = gc.GcOptions(older_than=_duration(parse_duration, "--older-than", older_than),
                            min_age=_duration(parse_duration, "--min-age", min_age),
                            max_depth=max_depth, presets=tuple(p.value for p in preset or ()), patterns=tuple(pattern or ()),
                            dry_run=dry_run or check)
        try:
            result = gc.run(roots, opts, progress=out.debug)
        except KeyboardInterrupt:
            raise Interrupted("interrupted before every leftover was handled",
                              "run gc-tmp again: a partly removed staging directory keeps its owner record "
                              "until its data is gone, so the next run finishes it") from None
    code = 0
    if result.problems:
        code = EXIT_OPERATIONAL
    elif check and result.leaked:
        code = EXIT_FINDINGS
    if json_:
        out.emit_json(out.document(code == 0, check=check, **result.to_dict()))
    else:
        _render(out, result, always=code != 0 or bool(result.removed) or bool(result.count(gc.Decision.WOULD_REMOVE)))
    for p in result.problems:
        out.error(f"{p.path}: {p.message}")
    if result.problems:
        for hint in dict.fromkeys(p.hint for p in result.problems if p.hint):
            out.err.print(f"hint: {hint}", style="cyan")
        if any(p.hint is None for p in result.problems):
            out.err.print("hint: fix the permissions (or run as the owner of those paths) and run gc-tmp again; "
                          "everything else was handled", style="cyan")
    elif check and result.leaked:
        out.err.print(f"hint: {plural(len(result.leaked), 'leftover')} found; run `ckptctl gc-tmp` without --check "
                      "(same options) to remove them", style="cyan")
    if code:
        raise typer.Exit(code)


def _duration(parse, flag: str, text: str) -> float:
    try:
        return parse(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}", f"use e.g. {flag} 30m, 6h or 2d") from None


def _owner_cell(c) -> str:
    from ckptctl.gc import Kind

    if c.kind == Kind.FOREIGN:
        return f"foreign: {c.match}"
    if c.kind == Kind.UNKNOWN:
        return "unknown"
    if not c.owner:
        return "none (empty stub)"
    return f"pid {c.owner.get('pid', '?')} @ {c.owner.get('host', '?')}"


def _render(out: Output, result, *, always: bool) -> None:
    """The table and the summary line on stdout. With -q only the result that matters: what was
    (or would be) removed, or what needs attention; nothing when nothing was (the cron line)."""
    from ckptctl.gc import Decision, format_age

    if out.verbosity < 0 and not always:
        return

    labels = {Decision.WOULD_REMOVE: "would remove"}

    roots = ", ".join(str(r) for r in result.roots)
    if not result.candidates:
        out.print(f"nothing to clean up below {roots} ({result.scanned:,} entries looked at)")
        return
    from rich.table import Table

    out.print(f"gc-tmp {roots}" + (" (dry run)" if result.options.dry_run else ""))  # not wrapped to the table
    table = Table()
    for col in ("path", "owner", "age", "size", "decision", "why"):
        table.add_column(col, justify="right" if col in ("age", "size") else "left",
                         overflow="fold")
    for c in result.candidates:
        decision = labels.get(c.decision, c.decision.value)
        if c.recovery and c.decision == Decision.REMOVED:
            decision += f" ({c.recovery})"
        table.add_row(str(c.path), _owner_cell(c), format_age(c.age), human_size(c.size), decision, c.reason)
    out.print(table)
    kept = result.count(Decision.KEPT)
    if result.options.dry_run:
        line = (f"would remove {result.count(Decision.WOULD_REMOVE)}, freeing {human_size(result.bytes_to_free)}; "
                f"keep {kept}")
    else:
        line = f"removed {len(result.removed)}, freed {human_size(result.bytes_freed)}; kept {kept}"
        deferred = result.count(Decision.DEFERRED)
        if deferred:
            line += f"; deferred {deferred} (files still open elsewhere)"
    out.print(line + f" ({result.scanned:,} entries looked at in {result.seconds:.2f}s)")
