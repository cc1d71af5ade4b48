"""ckptctl.worker: one call in a forked child, its result handed back, and every way the child
can fail turned into WorkerFailed (the caller then makes the call itself).

Each case runs in a fresh interpreter: the suite's own process has imported torch, whose thread
rightly keeps :func:`ckptctl.worker.available` from forking there."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import json, os, signal, sys, threading
    from ckptctl import worker
    CAPACITY = 1 << 20
    def double(values):
        return {k: 2 * v for k, v in values.items()}
    def fail():
        raise ValueError("the child's error")
    def big():
        return b"x" * (2 * CAPACITY)
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    def descriptors():
        return sorted(os.listdir("/proc/self/fd"))
    def two(values):
        yield sorted(values)
        yield len(values)
    def outcome(job):
        try:
            return ["result", job.result()]
        except worker.WorkerFailed as exc:
            return ["failed", str(exc)]
    if not worker.available():
        print(json.dumps("unavailable"))
        sys.exit(0)
""")


def _run(body: str):
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    if got == "unavailable":
        pytest.skip("no fork here: fewer than two CPUs in the affinity mask")
    return got


def test_the_child_works_on_the_callers_memory_and_hands_back_its_result() -> None:
    got = _run("""
        held = {str(i): i for i in range(1000)}  # the child's copy: nothing is sent to it
        job = worker.start(double, held, capacity=CAPACITY)
        first = outcome(job)
        job.close()  # idempotent
        print(json.dumps([first, double(held)]))
    """)
    assert got[0] == ["result", got[1]]


def test_a_generator_hands_back_each_value_in_turn() -> None:
    got = _run("""
        job = worker.start(two, {"b": 1, "a": 2}, capacity=CAPACITY)
        first, second = job.next(), job.next()
        job.done()
        print(json.dumps([first, second, outcome(job)[0]]))  # nothing after done
    """)
    assert got == [["a", "b"], 2, "failed"]


@pytest.mark.parametrize("fn", ["fail", "big", "die"], ids=["raises", "over-capacity", "killed"])
def test_a_failing_child_is_worker_failed(fn: str) -> None:
    got = _run(f"""
        print(json.dumps(outcome(worker.start({fn}, capacity=CAPACITY))))
    """)
    assert got[0] == "failed"


def test_the_child_keeps_only_its_result_pipe() -> None:
    """A descriptor the caller holds (a lock's) is closed in the child: the child sees 0, 1, 2,
    the result pipe and the one listdir opens."""
    got = _run("""
        with open(sys.executable, "rb"):
            print(json.dumps(outcome(worker.start(descriptors, capacity=CAPACITY))))
    """)
    assert got[0] == "result" and len(got[1]) == 5 and got[1][:3] == ["0", "1", "2"]


def test_a_job_closed_before_its_result_is_killed_and_reaped() -> None:
    got = _run("""
        job = worker.start(signal.pause, capacity=CAPACITY)
        pid = job._state.pid
        job.close()
        try:
            os.waitpid(pid, os.WNOHANG)
            reaped = False
        except ChildProcessError:  # reaped: no zombie left
            reaped = True
        print(json.dumps([reaped, outcome(job)[0]]))
    """)
    assert got == [True, "failed"]


def test_no_fork_beside_another_thread() -> None:
    got = _run("""
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        answer = [worker.available(), worker.start(double, {}, capacity=CAPACITY) is None]
        stop.set()
        t.join()
        print(json.dumps(answer))
    """)
    assert got == [False, True]
