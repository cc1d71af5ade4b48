"""Named fault points for the crash and fault-injection tests.

``CKPTCTL_KILL_AT=<point>`` makes the process SIGKILL itself when it reaches that point;
``CKPTCTL_STOP_AT=<point>`` makes it SIGSTOP itself there (a test then changes the world and
sends SIGCONT);
``CKPTCTL_FAIL_AT=<point>:<ERRNO>`` raises ``OSError(<ERRNO>)`` there (e.g. ``fsync-shard:EIO``,
``exchange:EINVAL``). Both are read once per call and cost a dict lookup when unset. Points are
listed in docs/ARCHITECTURE.md; they are the phase boundaries of the publish protocol.
"""

from __future__ import annotations

import errno as _errno
import os
import signal


def point(name: str) -> None:
    kill = os.environ.get("CKPTCTL_KILL_AT")
    if kill and kill == name:
        os.kill(os.getpid(), signal.SIGKILL)
    stop = os.environ.get("CKPTCTL_STOP_AT")
    if stop and stop == name:
        os.kill(os.getpid(), signal.SIGSTOP)
    fail = os.environ.get("CKPTCTL_FAIL_AT")
    if fail:
        where, _, code = fail.partition(":")
        if where == name:
            num = getattr(_errno, code or "EIO", _errno.EIO)
            raise OSError(num, f"{os.strerror(num)} (injected at {name})")
