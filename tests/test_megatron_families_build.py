"""The newer Megatron families' real checkpoints (issue 43), built once per session by
``tests/megatron_families_worker.py`` on 2 Gloo ranks, cached by megatron-core's version and the
builders' contents (``CKPTCTL_MEGATRON_FIXTURES``: a directory kept between sessions)."""

from __future__ import annotations

import hashlib
import os
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.ranks import build_once
from tests.test_megatron_build import NEEDS_MEGATRON, iteration  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "megatron_families_worker.py"
BUILDERS = (WORKER, REPO / "tests" / "megatron_worker.py")
NAMES = ("qwen3_tp2", "qwen3_moe_ep2", "qwen3_moe_grouped_ep2")


def cache_key() -> str:
    h = hashlib.sha256()
    for f in BUILDERS:
        h.update(f.read_bytes())
    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        version = "none"
    return f"{version}-{h.hexdigest()[:12]}"


def build(base: Path) -> dict[str, Path]:
    out = base / f"megatron-families-{cache_key()}"
    build_once(out, [sys.executable, str(WORKER), str(out), *NAMES], world=2,
               env=dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), timeout=900, what="Megatron families")
    return {name: out / name for name in NAMES}


@pytest.fixture(scope="session")
def family_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    kept = os.environ.get("CKPTCTL_MEGATRON_FIXTURES")
    return build(Path(kept) if kept else tmp_path_factory.getbasetemp())
