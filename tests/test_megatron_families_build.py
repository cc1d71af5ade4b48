"""The newer Megatron families' real checkpoints (issue 43), built once per session on 2 Gloo
ranks, each group cached by megatron-core's version and its builders' contents
(``CKPTCTL_MEGATRON_FIXTURES``: a directory kept between sessions): Qwen3 and Qwen3-MoE by
``tests/megatron_families_worker.py`` (about 55 s here), DeepSeek-V3 (MLA) and GLM-4.5 (MTP) by
``tests/megatron_moe_worker.py`` (about 40 s)."""

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
BASE = REPO / "tests" / "megatron_worker.py"
GROUPS = {  # worker: the fixtures it builds
    REPO / "tests" / "megatron_families_worker.py": ("qwen3_tp2", "qwen3_moe_ep2", "qwen3_moe_grouped_ep2",
                                                          "qwen3_moe_dense_ep2"),
    REPO / "tests" / "megatron_moe_worker.py": ("deepseek_tp2ep2", "glm_ep2_mtp"),
}
NAMES = tuple(n for names in GROUPS.values() for n in names)


def cache_key(worker: Path) -> str:
    h = hashlib.sha256()
    for f in (worker, BASE):
        h.update(f.read_bytes())
    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        version = "none"
    return f"{version}-{h.hexdigest()[:12]}"


def build(base: Path) -> dict[str, Path]:
    found = {}
    for worker, names in GROUPS.items():
        out = base / f"{worker.stem}-{cache_key(worker)}"
        build_once(out, [sys.executable, str(worker), str(out), *names], world=2,
                   env=dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), timeout=900, what="Megatron families")
        found.update({name: out / name for name in names})
    return found


@pytest.fixture(scope="session")
def family_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    kept = os.environ.get("CKPTCTL_MEGATRON_FIXTURES")
    return build(Path(kept) if kept else tmp_path_factory.getbasetemp())
