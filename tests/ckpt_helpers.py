"""Helpers shared by the writer/export/resave tests: build real checkpoints, run the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]


def run_ckptctl(*args: str, env: dict | None = None, timeout: float = 120, check: bool = False,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("CKPTCTL_KILL_AT", None)
    full_env.pop("CKPTCTL_FAIL_AT", None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptctl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def state(seed: int, n: int = 6, rows: int = 64, cols: int = 32, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(rows, cols, generator=g).to(dtype) for i in range(n)}


def write_sharded(d: Path, tensors: dict[str, torch.Tensor], per_shard: int) -> None:
    """A sharded safetensors checkpoint written with huggingface_hub's own saver."""
    from huggingface_hub import save_torch_state_dict

    d.mkdir(parents=True, exist_ok=True)
    size = sum(t.numel() * t.element_size() for t in list(tensors.values())[:per_shard])
    save_torch_state_dict({k: v.clone() for k, v in tensors.items()}, d, max_shard_size=size)


def write_single(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    """All tensors of a directory, the way a glob loader sees them (every *.safetensors)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} in two files"
            out[k] = v
    return out


def load_hub(d: Path) -> dict[str, torch.Tensor]:
    """What huggingface_hub's index-first rule would load."""
    import json

    idx = d / "model.safetensors.index.json"
    if idx.exists():
        wm = json.loads(idx.read_text())["weight_map"]
        out = {}
        for f in sorted(set(wm.values())):
            out.update(load_file(str(d / f)))
        return out
    return load_file(str(d / "model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def staging_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith("_tmp_"))


def wait_stopped(pid: int, timeout: float = 60) -> None:
    """Wait until a process stopped itself (CKPTCTL_STOP_AT): state T in /proc/PID/stat."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rfind(")") + 2] == "T":
            return
        time.sleep(0.01)
    raise AssertionError("writer did not stop")
