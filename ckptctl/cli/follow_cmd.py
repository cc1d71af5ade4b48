"""`ckptctl export SAVE_DIR DST_ROOT --follow`: the follower's options and how it reports.

``export_cmd`` declares these options (the aliases below) and hands a ``--follow`` run to
:func:`run_follow`. One line per event on stderr (nothing with ``-q``); with ``--json`` one JSON
document per event on stdout (JSON lines): ``{"schema_version": 1, "command": "export",
"ok": true, "tool_version": ..., "event": ..., "name": ..., "step": ..., "message": ..., ...}``, and a last
``{"event": "error", "ok": false, "error": {...}}`` when the follower stops on an error
(docs/schemas/export-follow.schema.json). The follow-only options default to None, so one given
without ``--follow`` is refused (:func:`refuse_follow_only`); ``--from`` and ``--priority`` are
choices from ``ckptctl.follow.choices``. SIGTERM, SIGHUP and Ctrl-C stop it cleanly: the running export cleans up (nothing is
half-published), a ``stopped`` event is reported and the exit code is 0.

No ``from __future__ import annotations`` (see ``verify_cmd``): Typer evaluates these aliases.
"""

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ckptctl.cli._options import choices
from ckptctl.follow.choices import FROM_CHOICES, PRIORITY_CHOICES

From = choices(FROM_CHOICES)
Priority = choices(PRIORITY_CHOICES)

# The follow-only options default to None (their defaults are applied in _follow, and shown in the
# help): a value given without --follow is then a usage error, never silently ignored.
FollowOpt = Annotated[bool, typer.Option("--follow", help="Follow SRC, a training job's output (Megatron --save, DeepSpeed or HF Trainer output, a folder of DCP step folders): publish each completed save as DST/<its name>. See docs/FOLLOW.md.")]
OnceOpt = Annotated[bool, typer.Option("--once", help="--follow: export what is complete now, then exit (the cron form).")]
FromOpt = Annotated[Optional[From], typer.Option("--from", show_default="newest", help="--follow: on the first start, export only the newest complete save already there, or all of them.")]
QuietPeriodOpt = Annotated[Optional[str], typer.Option("--quiet-period", metavar="DURATION", show_default="30s", help="--follow: how long nothing in a save must change before it counts as complete (e.g. 30s, 2m; 0: none).")]
PollOpt = Annotated[Optional[str], typer.Option("--poll-interval", metavar="DURATION", show_default="1s", help="--follow: time between two looks at SRC.")]
ExitWhenIdleOpt = Annotated[Optional[str], typer.Option("--exit-when-idle", metavar="DURATION", help="--follow: exit once nothing happened for DURATION.")]
KeepLastOpt = Annotated[Optional[int], typer.Option("--keep-last", metavar="K", help="--follow retention: keep the K newest exports.")]
KeepEveryOpt = Annotated[Optional[int], typer.Option("--keep-every", metavar="N", help="--follow retention: keep exports whose step is a multiple of N.")]
KeepBestOpt = Annotated[Optional[str], typer.Option("--keep-best", metavar="METRIC[:min|:max]", help="--follow retention: keep the export with the best METRIC in trainer_state.json's log_history.")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="--follow: verify each export after its publish; retention removes an old export only once a newer one verified clean.")]
OnPublishOpt = Annotated[Optional[str], typer.Option("--on-publish", metavar="CMD", help="--follow: run CMD (split like a shell would, run without one) with the new export's path appended; its failure does not stop following.")]
OnPublishTimeoutOpt = Annotated[Optional[str], typer.Option("--on-publish-timeout", metavar="DURATION", show_default="1h", help="--follow: kill the --on-publish command (its whole process group) after DURATION; recorded as a timeout, following goes on.")]
PriorityOpt = Annotated[Optional[Priority], typer.Option("--priority", show_default="low", help="--follow: CPU and I/O priority (low: nice +10, lowest best-effort I/O).")]

# export's parameter -> its flag, for every option that means something only with --follow
FOLLOW_ONLY = (("once", "--once"), ("start_from", "--from"), ("quiet_period", "--quiet-period"),
               ("poll_interval", "--poll-interval"), ("exit_when_idle", "--exit-when-idle"),
               ("keep_last", "--keep-last"), ("keep_every", "--keep-every"), ("keep_best", "--keep-best"),
               ("verify", "--verify"), ("on_publish", "--on-publish"), ("on_publish_timeout", "--on-publish-timeout"),
               ("priority", "--priority"))


def refuse_follow_only(given: dict[str, Any]) -> None:
    """A follow-only option given without ``--follow`` is a usage error (exit 2), never ignored."""
    flags = [flag for name, flag in FOLLOW_ONLY if given.get(name) not in (None, False)]
    if flags:
        from ckptctl.errors import UsageError

        raise UsageError(f"{', '.join(flags)} {'applies' if len(flags) == 1 else 'apply'} only with --follow",
                         "add --follow to follow a training job's output (docs/FOLLOW.md), or leave "
                         + ("it" if len(flags) == 1 else "them") + " out")


def run_follow(src: str, dst: str, *, json_: bool, quiet: int, verbose: int, **given: Any) -> None:
    """The ``--follow`` form of ``export`` (``given``: every other option of ``export``, by name)."""
    from ckptctl.cli._output import Output

    out = Output("export", json_mode=False, quiet=quiet + (1 if json_ else 0), verbose=verbose)
    with out.guard():
        from ckptctl.errors import CkptctlError

        try:
            _follow(out, src, dst, json_, given)
        except CkptctlError as exc:
            if json_:
                out.emit_json(_doc(out, {"event": "error", "name": None, "step": None, "message": str(exc)}, ok=False,
                                  error=exc.to_dict()))
            raise


def _doc(out: Any, event: dict[str, Any], *, ok: bool = True, **more: Any) -> dict[str, Any]:
    """One event's document: the four fields every document starts with, then the event's."""
    return out.document(ok, **event, **more)


def _follow(out: Any, src: str, dst: str, json_: bool, given: dict[str, Any]) -> None:
    from ckptctl.errors import UsageError
    from ckptctl.follow.loop import follow
    from ckptctl.follow.options import FollowOptions
    from ckptctl.follow.retention import Retention
    from ckptctl.sizes import parse_duration
    from ckptctl.write.options import ExportOptions

    def duration(flag: str, text: Optional[str]) -> Optional[float]:
        if text is None:
            return None
        try:
            return parse_duration(text)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}", f"e.g. {flag} 30s") from None

    if given.get("overwrite"):
        raise UsageError("--overwrite does not apply to --follow",
                         "the follower replaces only its own exports (a save written again)")
    try:
        import shlex

        hook = shlex.split(given["on_publish"]) if given.get("on_publish") is not None else None
    except ValueError as exc:
        raise UsageError(f"--on-publish: {exc}", "quote the command as a shell would") from None
    from ckptctl.staging.record import command_line

    command = command_line()
    export = ExportOptions(max_shard_size=given.get("max_shard_size"), dtype=given.get("dtype"),
                           fsync=not given.get("no_fsync"), manifest=bool(given.get("manifest")),
                           label=given.get("label"), dry_run=bool(given.get("dry_run")), names=given.get("names"),
                           vocab_size=given.get("vocab_size"), no_mtp=bool(given.get("no_mtp")),
                           config=given.get("config"), command=command)
    opts = FollowOptions(
        source=Path(os.path.abspath(src)), dst_root=Path(os.path.abspath(dst)), export=export,
        key=given.get("key"), only=given.get("only"), start_from=given.get("start_from") or "newest",
        quiet=duration("--quiet-period", given.get("quiet_period") or "30s") or 0.0,
        poll=duration("--poll-interval", given.get("poll_interval") or "1s") or 0.0,
        once=bool(given.get("once")), exit_when_idle=duration("--exit-when-idle", given.get("exit_when_idle")),
        retention=Retention.of(given.get("keep_last"), given.get("keep_every"), given.get("keep_best")),
        verify=bool(given.get("verify")), on_publish=hook, low_priority=(given.get("priority") or "low") == "low",
        hook_timeout=duration("--on-publish-timeout", given.get("on_publish_timeout") or "1h") or 0.0,
        command=command)

    def emit(event: Any) -> None:
        doc = event.to_dict()
        if json_:
            out.emit_json(_doc(out, doc))
        elif event.event == "warning":
            out.warn(event.message)
        elif event.event in ("lost", "refused") or (event.event == "hook" and doc.get("status") != "ok"):
            out.warn(event.message)
        else:
            out.info(event.message)

    try:
        follow(opts, emit)
    except KeyboardInterrupt:
        from ckptctl.cli._output import Signals
        import signal

        from ckptctl.follow.events import Event

        by = signal.Signals(Signals.received).name if Signals.received else "interrupt"
        emit(Event("stopped", f"{by} received: stopped following (nothing half-published)", fields={"signal": by}))
