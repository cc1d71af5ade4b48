"""The bench's multi-rank checkpoint builds: a module of ``bench.cases`` run as a ``world``-rank
Gloo job on this machine (``torchrun``'s environment, set by hand), for the cases whose inputs a
training framework must write itself (Megatron-core; ZeRO could share it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def launch(module: str, args: list[str], *, world: int, what: str, env: dict[str, str] | None = None) -> None:
    """Run ``python -m module *args`` on ``world`` ranks (``env`` added to each rank's
    environment) and wait for them all; RuntimeError naming ``what`` when any rank fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", module, *args],
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                       WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                                       **(env or {})))
             for r in range(world)]
    if any([p.wait() for p in procs]):
        raise RuntimeError(f"building the {what} failed")
