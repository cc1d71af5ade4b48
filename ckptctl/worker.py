"""One call run in a forked child while the caller goes on with other work (the second core).

:func:`start` forks a child that runs one call on what the caller holds at that moment (the
child's copy of its memory: nothing is sent to it) and hands its result back as a pickle in an
anonymous shared mapping; the parent meanwhile does its own work and then collects the result
with :meth:`Job.result`. A call that returns a generator hands back each value it yields, in
turn, as soon as it is made (:meth:`Job.next`): the parent may go on with the first while the
child works on the next. What the child returns is only ever a faster way to a value the caller
can compute itself: any failure of the child (an exception, a signal, a result past its mapping)
is :class:`WorkerFailed`, and the caller then makes the same call itself.

Only where a fork is safe and can run beside the caller (:func:`available`): Linux, the main
thread of a process that has no other thread (a lock another thread held would stay held in the
child), and at least two CPUs in the affinity mask.

The child never outlives its work or its parent: it restores the default action of SIGINT,
SIGTERM and SIGHUP (Ctrl-C reaches the whole process group and ends it at once), dies with its
parent (``PR_SET_PDEATHSIG``), closes every descriptor it inherited but its result pipe (a lock
the command holds stays the command's alone), turns off the garbage collector (it would touch,
and so copy, every page of the parent's heap) and ends with ``os._exit`` (no exit handler, no
flush of the parent's buffered output). A job is killed and reaped when :meth:`Job.close` is
called (by :meth:`Job.result`, by a caller interrupted while it waits) or when the job is collected.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import struct
import sys
import threading
import types
import weakref
from typing import Any, Callable


class WorkerFailed(Exception):
    """The child did not deliver a result; the caller makes the call itself."""


def available() -> bool:
    """Whether a child can be forked safely and run beside the caller (see the module)."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
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
    """A call running in a forked child (see the module)."""

    def __init__(self, pid: int, fd: int, shared: mmap.mmap) -> None:
        self._state = _Child(pid, fd, shared)
        self._end = weakref.finalize(self, self._state.end)

    def result(self) -> Any:
        """The call's return value (:meth:`next`), and the job done with (:meth:`done`)."""
        got = self.next()
        self.done()
        return got

    def next(self) -> Any:
        """The next value the child handed back, once it has written it (it writes where it is
        last). Raises :class:`WorkerFailed` (the child then killed and reaped)."""
        try:
            return self._state.next()
        except BaseException:
            self.close()
            raise

    def done(self) -> None:
        """No more values are taken: the pipe and the mapping released. A child that delivered
        is not waited for: it is ending on its own, and is reaped when the job is closed or
        collected."""
        self._state.release()

    def close(self) -> None:
        """Kill the child if it still runs, reap it, release the mapping (idempotent)."""
        self._end()


class _Child:
    """The forked process and what it shares with the parent (apart from :class:`Job`, so that a
    collected job can still end it)."""

    def __init__(self, pid: int, fd: int, shared: mmap.mmap) -> None:
        self.pid: int | None = pid
        self.fd: int | None = fd
        self.shared = shared

    def next(self) -> Any:
        if self.fd is None or self.shared.closed:
            raise WorkerFailed("the worker was ended before its result was taken")
        told = b""
        try:
            while len(told) < 16 and (chunk := os.read(self.fd, 16 - len(told))):
                told += chunk
        except OSError as exc:
            raise WorkerFailed(f"reading the worker's result: {exc}") from None
        if len(told) != 16:  # the child ended before this result was whole
            raise WorkerFailed("the worker ended without a result")
        begin, end = struct.unpack("<QQ", told)
        if not begin <= end <= len(self.shared):
            raise WorkerFailed("the worker's result overran its mapping")
        with memoryview(self.shared) as view:
            try:
                return pickle.loads(view[begin:end])  # our own child's pickle, of plain values
            except Exception as exc:  # noqa: BLE001 - a damaged result is never used half-way
                raise WorkerFailed(f"the worker's result is unreadable: {exc}") from None

    def release(self) -> None:
        """The pipe and the mapping closed; the child reaped if it has ended."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.shared.closed:
            self.shared.close()
        if self.pid is not None:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                done = self.pid
            if done:
                self.pid = None

    def end(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:  # reaped elsewhere (a caller's own waitpid(-1))
                pass
            self.pid = None
        if not self.shared.closed:
            self.shared.close()


def start(fn: Callable[..., Any], *args: Any, capacity: int) -> Job | None:
    """Run ``fn(*args)`` in a forked child whose pickled result must fit in ``capacity`` bytes
    (address space reserved, touched only as far as the pickle fills it); None when
    :func:`available` says no or the fork fails (the caller then makes the call itself)."""
    if not available():
        return None
    shared = mmap.mmap(-1, capacity)  # MAP_SHARED | MAP_ANONYMOUS: the child's writes are the parent's
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        shared.close()
        return None
    if pid == 0:  # pragma: no cover - the child; the tests judge it by what the parent gets
        _child(r, w, shared, fn, args)
    os.close(w)
    return Job(pid, r, shared)


def _child(r: int, w: int, shared: mmap.mmap, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    code = 1
    try:
        import gc

        gc.disable()
        parent = os.getppid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        try:
            from ckptctl._libc import die_with_parent

            die_with_parent(signal.SIGKILL)
        except OSError:
            pass
        if os.getppid() != parent:  # the parent ended before the line above
            return
        os.close(r)
        os.closerange(3, w)
        os.closerange(w + 1, _max_fd())
        got = fn(*args)
        for value in (got if isinstance(got, types.GeneratorType) else (got,)):
            begin = shared.tell()
            pickle.dump(value, shared, protocol=pickle.HIGHEST_PROTOCOL)  # ValueError past the capacity
            os.write(w, struct.pack("<QQ", begin, shared.tell()))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent makes the call itself and meets any error there
        pass
    finally:
        os._exit(code)


def _max_fd() -> int:
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 1024)
    except (OSError, ValueError):
        return 1 << 16
