"""Work on two threads, results in order, and a prompt stop.

``verify --deep`` and the manifest hash several files; hashlib, numpy and reads release the GIL,
so two files at a time keep both cores busy. When the caller gives up (Ctrl-C, SIGTERM, an
error), the files not started are dropped and the running ones see ``stop`` set at their next
chunk and raise :class:`Stopped`, so an interrupt waits for at most one chunk per thread.
:class:`HelpingPool` is the same with help: a worker with no job left runs the side work that the
running jobs hand over (a large file's float scan, while its hash stays on one thread).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
WORKERS = 2


class Stopped(Exception):
    """Raised in a worker whose caller has given up."""


def check(stop: threading.Event | None) -> None:
    """Between two chunks of a worker's job: raise :class:`Stopped` once the caller gave up."""
    if stop is not None and stop.is_set():
        raise Stopped


@contextmanager
def ordered_map(fn: Callable[[T, threading.Event], R], items: Sequence[T]) -> Iterator[Iterator[R]]:
    """``fn(item, stop)`` for every item on :data:`WORKERS` threads; yields an iterator of the
    results in item order (a worker's exception is raised when its result is taken). Leaving
    the block, normally or not, sets ``stop``, cancels what has not started and waits for the
    rest."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckptctl-worker")
    try:
        futures = [pool.submit(fn, item, stop) for item in items]
        yield (f.result() for f in futures)
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


class HelpingPool:
    """Jobs on ``workers`` threads, and help for the running ones.

    Each worker takes the next job and runs ``fn(job)``. A worker that finds no job left does not
    idle: it runs the tasks that the running jobs hand over (:meth:`offer`), until every job is
    done. ``verify --deep`` uses it so that a file's hash, which must stay on one thread, keeps
    one core while the float scan of its windows moves to the other: a single large file keeps
    both cores busy, and so does the last file of many. :meth:`run` sets :attr:`stop` when it
    returns or raises (a job or task that raised, Ctrl-C in the caller), and waits for every
    worker first; the first exception is raised."""

    def __init__(self, workers: int = WORKERS, backlog: int = 2) -> None:
        self.workers = max(1, workers)
        self.backlog = backlog  # tasks waiting for a helper, at most
        self.stop = threading.Event()
        self._cv = threading.Condition()
        self._tasks: deque[Callable[[], None]] = deque()
        self._next = 0  # the next job to take
        self._running = 0  # jobs taken and not finished
        self._helping = 0  # workers with no job left
        self._errors: list[BaseException] = []

    def offer(self, task: Callable[[], None]) -> bool:
        """Hand ``task`` to a worker that has no job left; False (the caller runs it itself)
        when none is, or when enough tasks wait already."""
        with self._cv:
            if not self._helping or len(self._tasks) >= self.backlog or self.stop.is_set():
                return False
            self._tasks.append(task)
            self._cv.notify()
        return True

    def run(self, fn: Callable[[T], None], jobs: Sequence[T]) -> None:
        threads = [threading.Thread(target=self._work, args=(fn, jobs), name=f"ckptctl-worker-{i}", daemon=True)
                   for i in range(self.workers)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self.stop.set()
            with self._cv:
                self._cv.notify_all()
            for t in threads:
                if t.ident is not None:
                    t.join()
        if self._errors:
            raise self._errors[0]

    def _work(self, fn: Callable[[T], None], jobs: Sequence[T]) -> None:
        cv = self._cv
        try:
            while True:
                with cv:
                    if self.stop.is_set() or self._next >= len(jobs):
                        self._helping += 1
                        break
                    job = jobs[self._next]
                    self._next += 1
                    self._running += 1
                try:
                    fn(job)
                finally:
                    with cv:
                        self._running -= 1
                        cv.notify_all()
            while True:
                with cv:
                    while not self._tasks and self._running and not self.stop.is_set():
                        cv.wait()
                    if not self._tasks or self.stop.is_set():
                        return
                    task = self._tasks.popleft()
                task()
        except BaseException as exc:  # noqa: BLE001 - raised by run() in the caller's thread
            with cv:
                self._errors.append(exc)
                self.stop.set()
                cv.notify_all()


class Buffers:
    """At most ``most`` bytearrays of ``size`` bytes, made when first needed and reused: a reader
    hands its windows to other threads without its memory growing."""

    def __init__(self, size: int, most: int) -> None:
        self.size, self.most = size, most
        self._cv = threading.Condition()
        self._free: list[bytearray] = []
        self._made = 0

    def take(self, stop: threading.Event | None = None) -> bytearray:
        """A free buffer (waiting for one when ``most`` are out; :class:`Stopped` once ``stop`` is set)."""
        with self._cv:
            while not self._free and self._made >= self.most:
                check(stop)
                self._cv.wait(0.1)
            if self._free:
                return self._free.pop()
            self._made += 1
        return bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        """``buf`` is free again."""
        with self._cv:
            self._free.append(buf)
            self._cv.notify()
