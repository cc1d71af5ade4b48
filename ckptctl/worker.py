"""One call run in a forked child while the caller goes on with other work (the second core).

A metadata pass over a checkpoint of 90k tensors parses two independent documents of about the
same size: the index (10 MB of JSON) and the shard headers. :func:`start` forks a child that
runs one call and hands its result back as a pickle in shared memory; the parent meanwhile does
its own share and then collects the result with :meth:`Job.result`.

Only where a fork is safe and useful (:func:`available`): Linux, the main thread of a process
that has no other thread (a lock held by another thread would stay held in the child; Python
3.12 warns about such forks), at least two CPUs in the affinity mask, and not turned off with
``CKPTCTL_WORKERS=0``. Anywhere else the caller runs the call itself.

The child never outlives its work: it restores the default action of SIGINT, SIGTERM and SIGHUP
(Ctrl-C reaches the whole process group and ends it at once), ends with ``os._exit`` (no atexit
handler, no flush of the parent's buffered output) and dies on EPIPE if the parent has gone. Any
failure in the child (an exception, a signal, a short pickle) is :class:`WorkerFailed`: the
caller then makes the same call itself, so an error is always raised by the code that would
have raised it without a worker. A parent interrupted while it works (Ctrl-C, SIGTERM) kills
and reaps the child before the interrupt goes on.
"""

from __future__ import annotations

import atexit
import mmap
import os
import pickle
import signal
import struct
import sys
import threading
from typing import Any, Callable

ENV = "CKPTCTL_WORKERS"  # "0": never fork


class WorkerFailed(Exception):
    """The child did not deliver a result; the caller runs the call itself."""


def available() -> bool:
    """Whether a fork is safe and can run beside the caller (see the module's docstring)."""
    if os.environ.get(ENV, "").strip() == "0" or sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    if threading.current_thread() is not threading.main_thread() or threading.active_count() != 1:
        return False
    try:
        if len(os.listdir("/proc/self/task")) != 1:  # a thread Python did not start (a C library's)
            return False
        return len(os.sched_getaffinity(0)) >= 2
    except OSError:
        return False


class Job:
    """A call running in a child process. Use as a context manager: leaving it without
    :meth:`result` (an exception in the caller's own work) kills and reaps the child.

    The result comes back through an anonymous shared mapping (``capacity`` bytes of address
    space, of which only what the pickle fills is ever touched): the parent unpickles it in
    place, without the copies and wake-ups of a pipe. The pipe only says how long it is."""

    def __init__(self, pid: int, fd: int, shared: mmap.mmap) -> None:
        self.pid: int | None = pid
        self.fd: int | None = fd
        self.shared: mmap.mmap | None = shared

    def result(self) -> Any:
        """The call's return value (waits for the child's length: it writes it once the pickle
        is whole, so the result does not wait for the child's exit). Raises :class:`WorkerFailed`."""
        assert self.fd is not None and self.pid is not None and self.shared is not None
        told = b""
        try:
            while len(told) < 8 and (chunk := os.read(self.fd, 8 - len(told))):
                told += chunk
        except OSError as exc:
            self.close()
            raise WorkerFailed(f"reading the worker's result: {exc}") from None
        try:
            if len(told) != 8:  # the child ended (or failed) before it wrote a length
                _, status = os.waitpid(self.pid, 0)
                self.pid = None
                raise WorkerFailed(f"worker ended with status {status}")
            (n,) = struct.unpack("<Q", told)
            if n > len(self.shared):
                raise WorkerFailed("worker's result overran its mapping")
            with memoryview(self.shared) as view:
                try:
                    got = pickle.loads(view[:n])
                except Exception as exc:  # a corrupt pickle: never trusted half-way
                    raise WorkerFailed(f"worker's result unreadable: {exc}") from None
        except BaseException:
            self.close()
            raise
        self.close(wait=False)  # the child is ending on its own: collected later (_reap)
        return got

    def close(self, *, wait: bool = True) -> None:
        """Kill the child if it still runs and reap it (``wait=False``: later, if it has not
        ended yet, :func:`_reap`); close the pipe and the mapping."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if wait:
                os.waitpid(self.pid, 0)
            else:
                _ending.append(self.pid)
                _reap(block=False)
            self.pid = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Children killed or done whose exit the parent has not collected yet: a child tearing down a
# copy of a large parent takes a few milliseconds, which the parent does not wait for. Collected
# without waiting at the next close or start, and waited for at exit.
_ending: list[int] = []


def _reap(block: bool) -> None:
    for pid in list(_ending):
        try:
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # collected elsewhere (a caller's own waitpid(-1))
            done = pid
        if done:
            _ending.remove(pid)


atexit.register(_reap, True)


def start(fn: Callable[..., Any], *args: Any, capacity: int) -> Job | None:
    """Run ``fn(*args)`` in a forked child whose pickled result must fit in ``capacity`` bytes;
    None when :func:`available` says no or the fork fails (the caller then runs it itself).
    ``fn``'s result must be picklable values of this package (it is unpickled only from our own
    child)."""
    if not available():
        return None
    _reap(block=False)
    shared = mmap.mmap(-1, capacity)  # MAP_SHARED | MAP_ANONYMOUS: the child's writes are ours
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        shared.close()
        return None
    if pid == 0:  # pragma: no cover - the child: measured by the tests through its result
        _child(r, w, shared, fn, args)
    os.close(w)
    return Job(pid, r, shared)


def _child(r: int, w: int, shared: mmap.mmap, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    code = 1
    try:
        parent = os.getppid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        try:
            from ckptctl._libc import die_with_parent

            die_with_parent(signal.SIGKILL)
        except OSError:
            pass
        if os.getppid() != parent:  # the parent died before the line above
            return
        # Every descriptor but the result pipe is closed: a lock the command holds (a staging
        # directory's) stays the parent's alone, and nothing the parent opens later is shared.
        os.close(r)
        os.closerange(3, w)
        os.closerange(w + 1, _max_fd())
        pickle.dump(fn(*args), shared, protocol=pickle.HIGHEST_PROTOCOL)  # ValueError past capacity
        os.write(w, struct.pack("<Q", shared.tell()))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent makes the call again and meets the error itself
        pass
    finally:
        os._exit(code)


def _max_fd() -> int:
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 1024)
    except (OSError, ValueError):
        return 1 << 16
