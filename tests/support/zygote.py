"""Run many ``ckptctl`` processes fast: each is forked from a warm interpreter that has already
imported torch and ckptctl (the ~2 s torch import is paid once).

The child runs exactly ``ckptctl.cli.main()`` with its own argv, environment, stdout and stderr,
and is a real process: its own pid, killed and stopped for real. Used by the crash campaign
(``tests/crash_harness``) and its long mode (``bench/crash_campaign.py``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.cli import REPO, RUN_TIMEOUT, Result, clean_env

_ZYGOTE = r"""
import json, os, signal, sys, traceback
proto_in = os.fdopen(int(sys.argv[1]), "r")
proto_out = os.fdopen(int(sys.argv[2]), "w")
# what a ckptctl run imports, loaded once; the children are forked from here
import torch, safetensors, safetensors.torch, numpy
import ckptctl.cli, ckptctl.api, ckptctl.resave, ckptctl.write.job, ckptctl.publish, ckptctl.gc
import ckptctl.verify, ckptctl.sources.safetensors_source, ckptctl.sources.torch_source
import ckptctl.cli.export_cmd, ckptctl.cli.resave_cmd, ckptctl.cli.gc_cmd, ckptctl.cli.verify_cmd
# verify's model-class check (resave --repair runs verify): the library's modeling code, once
try:
    import transformers.modeling_utils, ckptctl.verify.classes
except ImportError:
    pass
proto_out.write(json.dumps({"ready": os.getpid()}) + "\n"); proto_out.flush()
for line in proto_in:
    req = json.loads(line)
    if req["op"] == "wait":
        _, status = os.waitpid(req["pid"], 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        proto_out.write(json.dumps({"pid": req["pid"], "rc": rc}) + "\n"); proto_out.flush()
        continue
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            proto_in.close(); proto_out.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
            for fd, path in ((1, req["out"]), (2, req["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); os.dup2(f, fd); os.close(f)
            if req.get("cwd"):
                os.chdir(req["cwd"])
            os.environ.clear(); os.environ.update(req["env"])
            if req.get("drop_dac"):
                import ctypes
                libc = ctypes.CDLL(None, use_errno=True)
                # capset(2): keep every capability but DAC_OVERRIDE, DAC_READ_SEARCH, FOWNER
                hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
                data = (ctypes.c_uint32 * 6)()
                if libc.capget(hdr, data) != 0:
                    raise OSError(ctypes.get_errno(), "capget")
                mask = ~((1 << 1) | (1 << 2) | (1 << 3)) & 0xFFFFFFFF
                data[0] &= mask; data[1] &= mask
                if libc.capset(hdr, data) != 0:
                    raise OSError(ctypes.get_errno(), "capset")
            sys.argv = ["ckptctl", *req["argv"]]
            code = 0
            try:
                ckptctl.cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # what the interpreter's top level does with an uncaught exception
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    proto_out.write(json.dumps({"pid": pid}) + "\n"); proto_out.flush()
"""


class ZygoteHandle:
    def __init__(self, zygote: "ZygoteRunner", pid: int, out: str, err: str) -> None:
        self.zygote, self.pid, self.out, self.err = zygote, pid, out, err
        self.started = time.monotonic()

    def wait(self, timeout: float = RUN_TIMEOUT) -> Result:
        z = self.zygote
        z._send({"op": "wait", "pid": self.pid})
        reply = z._recv(timeout)
        timed_out = reply is None
        if timed_out:
            os.kill(self.pid, signal.SIGKILL)
            reply = z._recv(60)
        assert reply is not None and reply["pid"] == self.pid, reply
        texts = []
        for p in (self.out, self.err):  # absent when the child was killed before it opened them
            try:
                texts.append(Path(p).read_text(errors="replace"))
                os.unlink(p)
            except FileNotFoundError:
                texts.append("")
        res = Result(reply["rc"], texts[0], texts[1], time.monotonic() - self.started)
        if timed_out:
            raise TimeoutError(f"ckptctl did not finish within {timeout}s (killed): {res.stderr[-2000:]}")
        return res


class ZygoteRunner:
    """Forks each ``ckptctl`` process from a warm interpreter that has already imported torch and
    ckptctl: the child runs exactly ``ckptctl.cli.main()`` with its own argv, environment, stdout
    and stderr, is a real process (own pid, killed for real), and skips the ~2 s torch import.
    One request at a time is waited for; start several before waiting (second-writer tests)."""

    name = "zygote"

    def __init__(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="ckptctl-zygote-")
        r_req, w_req = os.pipe()
        r_rep, w_rep = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(r_req), str(w_rep)],
                                     pass_fds=(r_req, w_rep), env=clean_env(None), cwd=str(REPO),
                                     stdin=subprocess.DEVNULL)
        os.close(r_req)
        os.close(w_rep)
        self._w = os.fdopen(w_req, "w")
        self._r = r_rep
        self._buf = b""
        self._n = 0
        ready = self._recv(120)
        if ready is None or "ready" not in ready:
            raise RuntimeError("zygote did not start")

    def _send(self, doc: dict) -> None:
        self._w.write(json.dumps(doc) + "\n")
        self._w.flush()

    def _recv(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 65536)
                if not chunk:
                    raise RuntimeError("zygote died")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def start(self, argv: list[Any], env: dict[str, str] | None = None, cwd: str | None = None,
              drop_dac: bool = False) -> ZygoteHandle:
        self._n += 1
        out = os.path.join(self._tmp, f"{self._n}.out")
        err = os.path.join(self._tmp, f"{self._n}.err")
        self._send({"op": "spawn", "argv": [str(a) for a in argv], "env": clean_env(env), "cwd": cwd,
                    "out": out, "err": err, "drop_dac": drop_dac})
        reply = self._recv(60)
        assert reply is not None and "pid" in reply, reply
        return ZygoteHandle(self, reply["pid"], out, err)

    def run(self, argv: list[Any], env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT,
            cwd: str | None = None, drop_dac: bool = False) -> Result:
        return self.start(argv, env, cwd, drop_dac).wait(timeout)

    def close(self) -> None:
        try:
            self._w.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._r)
        shutil.rmtree(self._tmp, ignore_errors=True)
