"""Running ckptctl: in-process (Typer's ``CliRunner`` on the real app) and as a real process
(``python -m ckptctl`` in this interpreter's environment), plus the process helpers the
kill/stop tests need.

Every way of running the CLI starts from :func:`clean_env`: no ``CKPTCTL_*`` variable of the
calling environment (a debug flag, a fault point) leaks into a run unless the test passes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CKPTCTL = [sys.executable, "-m", "ckptctl"]
RUN_TIMEOUT = 300.0


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any ``CKPTCTL_*`` variable, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTCTL_")}
    env.update(extra or {})
    return env


# ---- in process --------------------------------------------------------------------------------


def invoke(*args: object, env: dict[str, str] | None = None) -> Any:
    """``ckptctl ARGS`` through ``typer.testing.CliRunner`` on the real app: a click ``Result``
    (``exit_code``, ``stdout``, ``stderr``). ``CKPTCTL_*`` variables are unset for the call."""
    from typer.testing import CliRunner

    from ckptctl.cli import app

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CKPTCTL_")}
    return CliRunner().invoke(app, [str(a) for a in args], env={**unset, **(env or {})}, prog_name="ckptctl")


# ---- real processes ----------------------------------------------------------------------------


def popen_ckptctl(*args: object, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                  preexec_fn: Any = None, stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.PIPE,
                  stderr: Any = subprocess.PIPE) -> subprocess.Popen:
    """Start ``python -m ckptctl ARGS`` (text streams) with a clean environment plus ``env``."""
    return subprocess.Popen([*CKPTCTL, *map(str, args)], stdin=stdin, stdout=stdout, stderr=stderr, text=True,
                            env=clean_env(env), cwd=cwd, preexec_fn=preexec_fn)


def communicate(proc: subprocess.Popen, timeout: float, input: str | None = None) -> tuple[str, str]:
    """Wait for ``proc``; on timeout kill it, collect what it wrote and re-raise (as
    ``subprocess.run`` does)."""
    try:
        return proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        exc.stdout, exc.stderr = proc.communicate()
        raise


def run_ckptctl(*args: object, env: dict[str, str] | None = None, timeout: float = 120, check: bool = False,
                cwd: str | os.PathLike[str] | None = None, input: str | None = None,
                preexec_fn: Any = None) -> subprocess.CompletedProcess:
    """``python -m ckptctl ARGS`` in a real process; ``check``: fail the test on a non-zero exit."""
    argv = [*CKPTCTL, *map(str, args)]
    proc = popen_ckptctl(*args, env=env, cwd=cwd, preexec_fn=preexec_fn,
                         stdin=subprocess.DEVNULL if input is None else subprocess.PIPE)
    out, err = communicate(proc, timeout, input)
    done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise AssertionError(f"ckptctl {' '.join(map(str, args))} failed ({done.returncode}):\n{err}")
    return done


def run_cli_subprocess(*args: object, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                       input: str | None = None, timeout: float = 120) -> tuple[int, str, str]:
    """:func:`run_ckptctl` as ``(exit code, stdout, stderr)``."""
    p = run_ckptctl(*args, env=env, cwd=cwd, input=input, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@dataclass
class Result:
    """One finished run of a runner (:class:`ExecRunner` or ``ZygoteRunner``)."""

    rc: int  # negative: killed by that signal (as subprocess reports it)
    stdout: str
    stderr: str
    seconds: float


class ExecHandle:
    def __init__(self, argv: list[str], env: dict[str, str] | None, cwd: str | None, drop_dac: bool) -> None:
        self.started = time.monotonic()
        self.proc = popen_ckptctl(*argv, env=env, cwd=cwd,
                                  preexec_fn=drop_dac_caps if drop_dac and os.geteuid() == 0 else None)
        self.pid = self.proc.pid

    def wait(self, timeout: float = RUN_TIMEOUT) -> Result:
        try:
            out, err = communicate(self.proc, timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"ckptctl did not finish within {timeout}s (killed): {str(exc.stderr)[-2000:]}") \
                from None
        return Result(self.proc.returncode, out, err, time.monotonic() - self.started)


class ExecRunner:
    """``python -m ckptctl ARGS`` in a fresh interpreter (the most faithful, the slowest). The
    same interface as ``ZygoteRunner``: ``start(argv) -> handle`` (``pid``, ``wait()``),
    ``run(argv) -> Result``, ``close()``."""

    name = "exec"

    def start(self, argv: list[Any], env: dict[str, str] | None = None, cwd: str | None = None,
              drop_dac: bool = False) -> ExecHandle:
        return ExecHandle([str(a) for a in argv], env, cwd, drop_dac)

    def run(self, argv: list[Any], env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT,
            cwd: str | None = None, drop_dac: bool = False) -> Result:
        return self.start(argv, env, cwd, drop_dac).wait(timeout)

    def close(self) -> None:
        pass


# ---- process helpers ---------------------------------------------------------------------------


def drop_dac_caps() -> None:
    """preexec_fn: as root, lose CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER across the
    exec that follows, so file permissions apply to the (uid 0) command like to any owner."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/PID/stat`` (``R``, ``S``, ``T``, ``Z`` ...); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat[stat.rfind(")") + 2]


def wait_stopped(pid: int, timeout: float = 120) -> None:
    """Wait until ``pid`` stopped itself (SIGSTOP at a ``CKPTCTL_STOP_AT`` point)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = process_state(pid)
        if st == "T":
            return
        if st in (None, "Z"):
            raise AssertionError(f"process {pid} exited instead of stopping")
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout}s")
