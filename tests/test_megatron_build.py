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

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.support.ranks import build_once

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


def build(out: Path) -> dict[str, Path]:
    """Every fixture under ``out`` (built once: later calls find them), as ``{name: root}``
    where root is Megatron-LM's ``--save`` directory (tracker, ``iter_0000007/``) beside which
    the worker left ``oracle_logits.pt``."""
    build_once(out, [sys.executable, str(WORKER), str(out), *NAMES], world=WORLD,
               env=dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), timeout=BUILD_TIMEOUT, what="Megatron")
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


def rewrite_args(folder: Path, **changes: object) -> None:
    """Rewrite an iteration folder's common.pt with some of its arguments changed (as a resumed run
    with other flags would save it)."""
    import argparse

    import torch

    path = folder / "common.pt"
    obj = torch.load(path, weights_only=False)
    args = vars(obj["args"]).copy()
    args.update(changes)
    obj["args"] = argparse.Namespace(**args)
    torch.save(obj, path)
