"""``ckptctl.threads.ordered_map``: results in item order whatever order the workers finish in,
and leaving the block early stops the running workers at their next chunk and never starts the
others (what makes Ctrl-C during ``verify --deep`` or a manifest prompt)."""

from __future__ import annotations

import threading
import time

import pytest

from ckptctl.threads import Stopped, check, ordered_map


def test_results_keep_the_item_order():
    def slow_first(i: int, stop: threading.Event) -> int:
        time.sleep(0.05 if i == 0 else 0)
        return i * i

    with ordered_map(slow_first, list(range(7))) as results:
        assert list(results) == [i * i for i in range(7)]


def test_leaving_early_stops_running_workers_and_skips_the_rest():
    started: list[int] = []
    stopped: list[int] = []
    running = threading.Barrier(3)

    def job(i: int, stop: threading.Event) -> int:
        started.append(i)
        if i < 2:
            running.wait(timeout=10)
            try:
                while True:  # a long file: one chunk after another
                    check(stop)
                    time.sleep(0.001)
            except Stopped:
                stopped.append(i)
                raise
        return i

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with ordered_map(job, list(range(10))):
            running.wait(timeout=10)  # both workers are inside their first item
            raise KeyboardInterrupt
    assert time.monotonic() - t0 < 5
    assert sorted(stopped) == [0, 1]
    assert sorted(started) == [0, 1]  # nothing else was started
