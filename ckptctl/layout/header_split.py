"""A sharded checkpoint's headers decoded on two cores: a forked child takes shards from the back.

A checkpoint of 90k tensors holds about as many bytes of index (10 MB of JSON) as of shard
headers, and a metadata pass (verify, inspect, a repair's analysis, an export's plan) parses both
one after the other on one core. When a :class:`~ckptctl.layout.reading.MetadataReading` is about
to parse an index of :data:`SPLIT_INDEX_BYTES` or more, :meth:`HeaderSplit.start` forks a child
that decodes the shard headers beside it, taking shards from the back of the sorted list while
this process parses the index and then reads shards from the front. Each side marks a shard in
memory both share before it decodes it and looks at the other's mark after: where they meet, a
shard may be decoded twice, never by neither. What the child decoded comes back once, as a pickle
in an anonymous shared mapping, and only fills the reading's cache of decoded headers: a header is
still read from its file at every read and a decoding is used only for the very bytes it was made
from. So the split decides how fast a pass is, never what it finds; a child that fails (killed,
out of room for its pickle) leaves its shards to be decoded here.

Forked only where that is safe and useful (:func:`can_fork`): Linux, no thread but the main one
(a lock another thread held would stay held in the child), two CPUs or more in the affinity mask.
The child restores the default action of SIGINT, SIGTERM and SIGHUP, dies with its parent
(``PR_SET_PDEATHSIG``), closes every descriptor it inherited but its result pipe (a lock the
command holds stays the command's), and ends with ``os._exit``. It is killed and reaped when its
result is taken, when :meth:`HeaderSplit.close` is called, or when the split is collected.
``CKPTCTL_FAST_SPLIT=0`` (:mod:`ckptctl.fastpaths`) turns it off: every header is decoded here.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import struct
import sys
import threading
import weakref
from typing import Any, Callable

# An index this large (about 10k tensors) starts a split; below it a fork costs more than it saves.
SPLIT_INDEX_BYTES = 1 << 20
# the child's pickled result: address space reserved, touched only as far as the pickle fills it
_CAPACITY = 1 << 30

# what the child returns per shard it decoded: (path, the reading's cache entry)
Decoded = tuple[str, Any]


def can_fork() -> bool:
    """Whether a child can be forked safely and run beside this process."""
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


class HeaderSplit:
    """The child decoding ``paths`` from the back (see the module's docstring)."""

    def __init__(self, paths: list[str], pid: int, fd: int, shared: mmap.mmap, board: mmap.mmap) -> None:
        self._slot = {p: i for i, p in enumerate(paths)}
        self._n = len(paths)
        self._board = board
        self._state = _Child(pid, fd, shared)
        self._close = weakref.finalize(self, self._state.end)
        self.taken = False  # the child's result has been taken (or given up)

    @classmethod
    def start(cls, paths: list[str], decode: Callable[[str], Any]) -> "HeaderSplit | None":
        """Fork a child that runs ``decode(path)`` (a cache entry, or None for a file it cannot
        decode) for ``paths`` from the last; None where :func:`can_fork` says no or the fork fails."""
        if len(paths) < 2 or not can_fork():
            return None
        board = mmap.mmap(-1, 2 * len(paths))  # MAP_SHARED | MAP_ANONYMOUS: one byte per shard and side
        shared = mmap.mmap(-1, _CAPACITY)
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            for fd in (r, w):
                os.close(fd)
            shared.close()
            board.close()
            return None
        if pid == 0:  # pragma: no cover - the child; the tests judge it by what the parent gets
            _child(paths, decode, board, shared, r, w)
        os.close(w)
        return cls(paths, pid, r, shared, board)

    def mine(self, path: str) -> bool:
        """Whether this process decodes ``path`` itself: False when the child has taken it
        (:meth:`take` then gives what the child decoded)."""
        i = self._slot.get(path)
        if i is None or self.taken:
            return True
        self._board[i] = 1
        return not self._board[self._n + i]

    def take(self) -> list[Decoded]:
        """What the child decoded, once it is done; [] when it failed. Ends the child."""
        if self.taken:
            return []
        self.taken = True
        try:
            return self._state.result()
        finally:
            self.close()

    def close(self) -> None:
        """Kill and reap the child if it still runs; release the shared memory."""
        self.taken = True
        self._close()
        if not self._board.closed:
            self._board.close()


class _Child:
    """The forked process and what it shares with this one (kept apart from :class:`HeaderSplit`
    so that a collected split can still end it)."""

    def __init__(self, pid: int, fd: int, shared: mmap.mmap) -> None:
        self.pid: int | None = pid
        self.fd: int | None = fd
        self.shared = shared

    def result(self) -> list[Decoded]:
        told = b""
        assert self.fd is not None
        try:
            while len(told) < 8 and (chunk := os.read(self.fd, 8 - len(told))):
                told += chunk
        except OSError:
            return []
        if len(told) != 8:  # the child ended before its result was whole
            return []
        (n,) = struct.unpack("<Q", told)
        if n > len(self.shared):
            return []
        with memoryview(self.shared) as view:
            try:
                got = pickle.loads(view[:n])  # our own child's pickle, of this package's types
            except Exception:  # noqa: BLE001 - a damaged result is never used half-way
                return []
        return got if isinstance(got, list) else []

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


def _child(paths: list[str], decode: Callable[[str], Any], board: mmap.mmap, shared: mmap.mmap,
           r: int, w: int) -> None:
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
        if os.getppid() != parent:  # the parent ended before the line above
            return
        os.close(r)
        os.closerange(3, w)
        os.closerange(w + 1, _max_fd())
        n = len(paths)
        done: list[Decoded] = []
        for i in range(n - 1, -1, -1):
            board[n + i] = 1
            if board[i]:  # the parent has come this far
                break
            entry = decode(paths[i])
            if entry is not None:
                done.append((paths[i], entry))
        pickle.dump(done, shared, protocol=pickle.HIGHEST_PROTOCOL)  # ValueError past the capacity
        os.write(w, struct.pack("<Q", shared.tell()))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent decodes these shards itself
        pass
    finally:
        os._exit(code)


def _max_fd() -> int:
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 1024)
    except (OSError, ValueError):
        return 1 << 16
