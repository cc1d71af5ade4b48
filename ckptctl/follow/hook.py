"""The ``--on-publish`` command: run without a shell, in a process group of its own, for at most
``--on-publish-timeout``.

The command starts a new session (``start_new_session``: its own process group, no controlling
terminal), so everything it starts (a shell script's ``sleep``, an uploader's workers) can be
ended at once: when the time is up the whole group gets SIGTERM, then SIGKILL after
:data:`GRACE` seconds if anything of it is left; a hung upload never stops following. The same
happens when the follower is stopped (SIGTERM, Ctrl-C) while the command runs: the record still
says ``pending`` and the next follower runs it again. Its stdout goes to the follower's stderr
(stdout carries the follower's JSON lines); stdin is ``/dev/null``. A stop asked for while the
command is being started is held back until its pid is known, then acted on (:func:`_hold`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

GRACE = 5.0  # seconds between SIGTERM and SIGKILL of a command's group
DEFAULT_TIMEOUT = 3600.0  # --on-publish-timeout: an upload of a large export fits; a hung one ends


@dataclass(frozen=True)
class Outcome:
    status: str  # ok (exit 0), failed (another exit, or it could not start), timeout (its group was killed)
    exit_code: int | None  # None when it could not start or was killed for the timeout
    error: str | None
    seconds: float


def run_hook(argv: list[str], timeout: float) -> Outcome:
    """Run ``argv``; KeyboardInterrupt (the follower stopped) ends its group first, then goes on."""
    started = time.monotonic()
    deferred: list[int] = []
    previous = _hold(deferred)  # from here until proc is known, a stop signal only waits
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=2, start_new_session=True)
    except OSError as exc:
        _release(previous, deferred)
        return Outcome("failed", None, f"{argv[0]}: {exc.strerror or exc}", round(time.monotonic() - started, 3))
    except BaseException:
        _release(previous, deferred)
        raise
    try:
        _release(previous, deferred)  # a stop asked for while it started is acted on now, proc known
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_group(proc)
        return Outcome("timeout", None, f"still running after {timeout:g}s: its process group was killed",
                       round(time.monotonic() - started, 3))
    except BaseException:
        end_group(proc)
        raise
    return Outcome("ok" if code == 0 else "failed", code, None if code == 0 else f"exit {code}",
                   round(time.monotonic() - started, 3))


def _hold(deferred: list[int]) -> dict[int, Any]:
    """Hold SIGINT, SIGTERM and SIGHUP back (``deferred`` gets them) while the command starts: a
    handler raising KeyboardInterrupt inside ``Popen``, after the fork, would leave a running
    command whose pid nobody knows. Returns the handlers to put back. Only the main thread can
    set handlers; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        handler = signal.getsignal(sig)
        if handler is not None:  # None: a handler set outside Python, left alone
            previous[sig] = signal.signal(sig, lambda signum, _frame: deferred.append(signum))
    return previous


def _release(previous: dict[int, Any], deferred: list[int]) -> None:
    """Put the handlers back, then deliver the first signal held back (its handler runs now)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if deferred:
        signal.raise_signal(deferred[0])


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group (its session: the pgid is its pid), SIGKILL after
    :data:`GRACE` seconds if the leader has not exited, and SIGKILL to whatever of the group is
    left (a child that ignored SIGTERM); the leader is reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break  # nothing of the group is left
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:
                continue
            try:  # the leader went: anything of its group still there goes now
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            break
    proc.wait()
