"""Work on two threads, results in order, and a prompt stop.

``verify --deep`` and the manifest hash several files; hashlib, numpy and reads release the GIL,
so two files at a time keep both cores busy. When the caller gives up (Ctrl-C, SIGTERM, an
error), the files not started are dropped and the running ones see ``stop`` set at their next
chunk and raise :class:`Stopped`, so an interrupt waits for at most one chunk per thread.
"""

from __future__ import annotations

import threading
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
