"""Fixtures built once by a real multi-rank job (DeepSpeed, Megatron-core): ``WORLD`` processes
with torch.distributed's environment over a free local port, each running ``argv``."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.support.cli import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_once(out: Path, argv: list[str], *, world: int, env: dict[str, str], timeout: float, what: str) -> None:
    """Run ``argv`` on ``world`` ranks to build fixtures under ``out``, once: a ``done.json`` stamp
    marks them built (a directory left by a failed build is cleared first), and concurrent
    sessions wait on ``out/.lock``. ``env`` is added to each rank's environment. A rank that fails
    fails the build with every rank's log tail; one past ``timeout`` seconds kills them all."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "done.json").exists():
            return
        for child in out.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
        start = time.monotonic()
        port = free_port()
        procs = []
        for rank in range(world):
            rank_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                            WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                            PYTHONPATH=str(REPO), **env)
            procs.append(subprocess.Popen(argv, env=rank_env, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        if any(p.returncode for p in procs):
            raise RuntimeError(f"building the {what} fixtures failed:\n" + "\n".join(log[-4000:] for log in logs))
        (out / "done.json").write_text(json.dumps({"seconds": round(time.monotonic() - start, 1)}))
