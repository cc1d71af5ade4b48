"""Real Megatron-core ``torch_dist`` checkpoints for the Megatron source's tests, built once per session.

``tests/megatron_worker.py`` is launched as a 2-rank Gloo job on the CPU (megatron-core 0.16.1,
a test extra): it saves each fixture of its ``FIXTURES`` (Llama-style GQA at tensor-parallel 2
with Adam's state, a tied head at pipeline-parallel 2, Qwen2-style QKV bias at tensor-parallel 2,
Mixtral-style MoE at expert-parallel 2) as Megatron-LM lays a checkpoint out, then loads each
back into a degree-1 model with Megatron's own loader and writes the logits of Megatron's own
forward (``oracle_logits.pt``). One launch builds them all (about 35 s here; importing
megatron.core is most of it).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "megatron_worker.py"
WORLD = 2
BUILD_TIMEOUT = 600
NAMES = ("llama_tp2", "llama_pp2_tied", "qwen2_tp2", "mixtral_ep2")
ITERATION = 7
# found, not imported: the tests' own process never imports megatron (nor does ckptctl)
NEEDS_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed (a test extra)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(out: Path) -> dict[str, Path]:
    """Every fixture under ``out`` (built once: later calls find them), as ``{name: root}``
    where root is Megatron-LM's ``--save`` directory (tracker, ``iter_0000007/``) beside which
    the worker left ``oracle_logits.pt``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done.json").exists():
            for child in out.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
            start = time.monotonic()
            port = _port()
            procs = []
            for rank in range(WORLD):
                env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                           WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                           PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
                procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out), *NAMES], env=env, cwd=REPO,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            logs = []
            for p in procs:
                try:
                    logs.append(p.communicate(timeout=BUILD_TIMEOUT)[0])
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    raise
            if any(p.returncode for p in procs):
                raise RuntimeError("building the Megatron fixtures failed:\n" + "\n".join(l[-4000:] for l in logs))
            (out / "done.json").write_text(json.dumps({"seconds": round(time.monotonic() - start, 1)}))
    return {name: out / name for name in NAMES}


@pytest.fixture(scope="session")
def megatron_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{name: --save root}`` of every fixture, built once per session (or once in
    ``CKPTCTL_MEGATRON_FIXTURES`` when set: a directory kept between sessions while working on
    the tests; remove it after changing the worker)."""
    kept = os.environ.get("CKPTCTL_MEGATRON_FIXTURES")
    return build(Path(kept) if kept else tmp_path_factory.getbasetemp() / "megatron-fixtures")


def iteration(root: Path) -> Path:
    """The iteration folder of a fixture."""
    return root / f"iter_{ITERATION:07d}"
