"""Named fault points for the crash and fault-injection tests.

``CKPTCTL_KILL_AT=<point>`` makes the process SIGKILL itself when it reaches that point;
``CKPTCTL_STOP_AT=<point>`` makes it SIGSTOP itself there (a test then changes the world and
sends SIGCONT);
``CKPTCTL_FAIL_AT=<point>:<ERRNO>`` raises ``OSError(<ERRNO>)`` there (e.g. ``fsync-shard:EIO``,
``exchange:EINVAL``). All are read at every call; when none is set, a point costs three
look-ups in ``os.environ``'s store. Points are listed in docs/ARCHITECTURE.md; they are the
phase boundaries of the publish protocol.
"""

from __future__ import annotations

import errno as _errno
import os
import signal


# os.environ's own store (encoded keys; every change to os.environ updates it): a miss costs a
# dict lookup there, where os.environ.get pays for a KeyError (1.2 us; a point is passed per run of
# tensors copied, 5,900 times in an export of 92k tensors). None where the store is not there.
_STORE = getattr(os.environ, "_data", None) if os.name == "posix" else None
_KEYS = tuple(k.encode() for k in ("CKPTCTL_KILL_AT", "CKPTCTL_STOP_AT", "CKPTCTL_FAIL_AT"))


def point(name: str) -> None:
    store = _STORE
    if store is not None and not (_KEYS[0] in store or _KEYS[1] in store or _KEYS[2] in store):
        return
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
