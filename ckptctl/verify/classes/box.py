"""The box the model-class check runs in (issue 44): a child process (:mod:`.child`) that builds
the classes a stranger's config.json names, with a wall-clock limit, an address-space limit and no
network for its whole life, so that no config can make verify hang, exhaust the machine, reach the
network or exit.

One :class:`ClassBox` serves every checkpoint of a verify run (the process's :func:`shared_box`):
its child starts on the first check and keeps the libraries it imported (torch, transformers,
...) until the box is closed (at interpreter exit), so verifying many paths pays the import once.
A check that hits a bound (time, memory, network) or
whose child dies is an answer of kind ``bound``/``died``; after a time or memory bound, or a
death, the next check gets a new child. Only data crosses the boundary: config.json as parsed, ``[name, dtype, shape]`` rows, and
back an :class:`~.outcome.Outcome` as a dict.

Bounds (defaults fit a CI runner): ``CKPTCTL_CLASS_TIMEOUT`` seconds per check (120, the first
check's library import included) and ``CKPTCTL_CLASS_MEMORY`` bytes of address space (``4GiB``;
decimal or binary units). The child's environment turns every download off
(:func:`child_environment`).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from ckptctl.errors import UsageError
from ckptctl.format.tensor import TensorSpec
from ckptctl.sizes import parse_size

TIMEOUT_ENV, MEMORY_ENV = "CKPTCTL_CLASS_TIMEOUT", "CKPTCTL_CLASS_MEMORY"
DEFAULT_TIMEOUT = 120.0  # seconds per check
DEFAULT_MEMORY = 4 << 30  # bytes of address space (torch and transformers imported map about 1 GiB)
# the child's environment: the Hub (diffusers and transformers read it), transformers and datasets offline, the kernels
# package off (transformers' integrations/hub_kernels.py reads USE_HUB_KERNELS), no telemetry or
# progress bars, one thread, few malloc arenas (each reserves address space)
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "USE_HUB_KERNELS": "NO", "HF_HUB_DISABLE_TELEMETRY": "1", "DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
# caches redirected into the box's own empty folder: nothing a user downloaded earlier is read
CACHES = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE",
          "DIFFUSERS_CACHE", "TORCH_HOME", "XDG_CACHE_HOME", "HF_DATASETS_CACHE", "HF_XET_CACHE",
          "HF_ASSETS_CACHE", "HUGGINGFACE_ASSETS_CACHE")
DROPPED = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT", "PYTHONSTARTUP", "PYTHONINSPECT")
CHUNK = 1 << 16


def timeout_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``CKPTCTL_CLASS_TIMEOUT`` (seconds, > 0) or the default; a bad value is a usage error."""
    text = (os.environ if environ is None else environ).get(TIMEOUT_ENV)
    if text is None or text == "":
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 < value < 1e7):
        raise UsageError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds",
                         f"set it to the model-class check's time limit, e.g. {TIMEOUT_ENV}=120")
    return value


def memory_from_env(environ: Mapping[str, str] | None = None) -> int:
    """``CKPTCTL_CLASS_MEMORY`` (a size: ``4GiB``, ``6GB``, bytes) or the default; a bad value is
    a usage error."""
    text = (os.environ if environ is None else environ).get(MEMORY_ENV)
    if text is None or text == "":
        return DEFAULT_MEMORY
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"{MEMORY_ENV}={text!r}: {exc}",
                         f"set it to the model-class check's address-space limit, e.g. {MEMORY_ENV}=4GiB") from None


def child_environment(home: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the parent's, every download off, the caches in ``home`` (empty,
    the box's own), no Hub token."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in DROPPED}
    env.update(OFFLINE)
    for k in CACHES:
        env[k] = os.path.join(home, k.lower())
    return env


def rows(tensors: Mapping[str, TensorSpec]) -> list[list[Any]]:
    """A checkpoint's tensors as the child reads them."""
    return [[name, t.dtype, list(t.shape)] for name, t in tensors.items()]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class ClassBox:
    """The class-check child of one verify run: started on the first :meth:`ask`, replaced after
    a bound was hit or it died, stopped by :meth:`close` (or leaving the ``with`` block)."""

    def __init__(self, timeout: float | None = None, memory: int | None = None) -> None:
        self.timeout = timeout_from_env() if timeout is None else float(timeout)
        self.memory = memory_from_env() if memory is None else int(memory)
        self.started = 0  # children started (one per run unless a bound replaced one)
        self._proc: subprocess.Popen[bytes] | None = None
        self._req: int | None = None
        self._resp: int | None = None
        self._home: str | None = None
        self._buffer = b""
        self._lock = threading.Lock()  # one request at a time

    def __enter__(self) -> "ClassBox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def bounds(self) -> str:
        """The bounds, as a note names them."""
        return f"{self.timeout:g} s ({TIMEOUT_ENV}), {self.memory / (1 << 30):.3g} GiB of address space ({MEMORY_ENV})"

    def _start(self) -> None:
        self._home = tempfile.mkdtemp(prefix="ckptctl-class-")
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        try:
            # -P: no script folder on sys.path; its working folder is the box's own empty one anyway
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "ckptctl.verify.classes.child", str(req_r), str(resp_w), str(self.memory)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(req_r, resp_w), env=child_environment(self._home), cwd=self._home, start_new_session=True)
        except OSError:
            for fd in (req_r, req_w, resp_r, resp_w):
                os.close(fd)
            self._cleanup_home()
            raise
        os.close(req_r)
        os.close(resp_w)
        self._req, self._resp, self._buffer = req_w, resp_r, b""
        os.set_blocking(req_w, False)
        self.started += 1

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """The child's answer to ``request`` (a dict of kind ``outcome``, ``not_checked``,
        ``refused``, ``failed``, ``bound`` with ``which``, or ``died``). Never raises for what the
        child does."""
        with self._lock:
            return self._ask(request)

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._proc is not None and self._proc.poll() is not None:
            self._stop(kill=False)  # gone between checks (killed with the thread that started it): a new one
        if self._proc is None:
            try:
                self._start()
            except OSError as exc:
                return {"kind": "failed", "reason": f"the class-check process cannot start: {exc.strerror or exc}"}
        data = json.dumps(request).encode() + b"\n"
        answer = self._exchange(data, time.monotonic() + self.timeout)
        if answer.get("which") == "time":
            self._stop(kill=True)  # still building
        elif answer.get("kind") == "died" or answer.get("restart"):
            self._stop(kill=False)  # gone, or leaving (a refused allocation may leave a library half-initialised)
        return answer

    def _exchange(self, data: bytes, deadline: float) -> dict[str, Any]:
        assert self._req is not None and self._resp is not None
        sent = 0
        while True:
            nl = self._buffer.find(b"\n")
            if nl >= 0:
                line, self._buffer = self._buffer[:nl], self._buffer[nl + 1:]
                try:
                    answer = json.loads(line)
                except ValueError:
                    return {"kind": "died", "reason": "it answered with something that is not JSON"}
                return answer if isinstance(answer, dict) else {"kind": "died", "reason": "it answered a non-object"}
            left = deadline - time.monotonic()
            if left <= 0:
                return {"kind": "bound", "which": "time", "reason": f"it ran past {self.timeout:g} s"}
            writing = [self._req] if sent < len(data) else []
            readable, writable, _ = select.select([self._resp], writing, [], min(left, 1.0))
            if writable:
                try:
                    sent += os.write(self._req, data[sent:sent + CHUNK])
                except BlockingIOError:
                    pass
                except OSError:  # the child is gone: its end of the pipe closed
                    return self._died()
            if readable:
                chunk = os.read(self._resp, CHUNK)
                if not chunk:
                    return self._died()
                self._buffer += chunk

    def _died(self) -> dict[str, Any]:
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return {"kind": "died", "reason": f"the process building the class {describe_exit(code)}"}

    def _stop(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        for fd in (self._req, self._resp):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._req = self._resp = None
        if proc is not None:
            if kill or proc.poll() is None:
                try:
                    proc.wait(timeout=0 if kill else 5)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and what it started
                    except (ProcessLookupError, PermissionError):
                        pass
                    proc.wait()
        self._cleanup_home()

    def _cleanup_home(self) -> None:
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def close(self) -> None:
        """End the child: its requests end (it exits), or it is killed when it does not."""
        self._stop(kill=False)



class SharedBox:
    """The process's box, for every verify run in it: made on first use (with the bounds the
    environment gives then; a change of them makes a new one), closed at interpreter exit or by
    :func:`close_shared_box`. A forked process makes its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._box: ClassBox | None = None
        self._pid = 0
        self._registered = False

    def get(self) -> ClassBox:
        timeout, memory = timeout_from_env(), memory_from_env()
        with self._lock:
            box = self._box
            if box is not None and self._pid != os.getpid():
                box = None  # a fork's copy: the pipes are the parent's
            elif box is not None and (box.timeout, box.memory) != (timeout, memory):
                box.close()
                box = None
            if box is None:
                box = self._box = ClassBox(timeout, memory)
                self._pid = os.getpid()
                if not self._registered:
                    atexit.register(self.close)
                    self._registered = True
            return box

    def close(self) -> None:
        with self._lock:
            box, self._box = self._box, None
            if box is not None and self._pid == os.getpid():
                box.close()


SHARED = SharedBox()


def shared_box() -> ClassBox:
    """The box every class check of this process uses (:class:`SharedBox`)."""
    return SHARED.get()


def close_shared_box() -> None:
    """End the shared box's child now (the next class check starts another)."""
    SHARED.close()
