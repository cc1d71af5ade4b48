"""Export of torch's DCP-HF sharded output (``HuggingFaceStorageWriter(save_distributed=True)``:
each rank's safetensors with ``DCP_SHARDING_INFO``; ``enable_consolidation=True`` would put them in
``sharded/``) to one consolidated checkpoint, as ratios to ``cp -r`` + ``sync`` of the save, beside torch's own consolidation
(``consolidate_safetensors_files``, the function ``enable_consolidation=True`` runs after a save).

The save is made by torch itself: this module run as a 2-rank Gloo job, the 2 GB bf16 Llama-shaped
checkpoint of :mod:`bench.gen` loaded on both ranks, every 2-D tensor a DTensor sharded by rows
(``Shard(0)``, each rank holding its own rows, nothing sent), the rest whole, saved without
consolidation.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command, clear

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)
WORLD = 2
CONSOLIDATE = ("import os, sys, json, warnings; warnings.simplefilter('ignore'); os.makedirs(sys.argv[2]); "
               "from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files as f; "
               "f(sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])))")


def root_of() -> Path:
    return WORK / f"{SPEC.name()}-dcp-hf"


def make(root: Path) -> None:
    """The sharded save of the 2 GB checkpoint in ``root/save`` (once: a ``done.json`` stamp beside
    it), and ``mapping.json``: every tensor into one of 4 output files, for torch's consolidation."""
    src = ensure(SPEC)
    stamp = root / "done.json"
    if stamp.exists():
        return
    clear(root)()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.cases.dcp_hf", str(src), str(root)],
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                       WORLD_SIZE=str(WORLD)))
             for r in range(WORLD)]
    if any(p.wait() for p in procs):
        raise RuntimeError("building the DCP-HF sharded save failed")
    stamp.write_text(json.dumps({"spec": SPEC.name(), "world": WORLD}))


def _case() -> Case:
    root = root_of()
    cp_dst, ours, torch_out = (WORK / "out" / f"dcp-hf-{x}" for x in ("cp", "ckptctl", "torch"))
    mapping = root / "mapping.json"
    return Case("dcp-hf-export", f"{SPEC.name()} saved by torch's HuggingFaceStorageWriter on {WORLD} ranks "
                                 "(rows sharded): consolidated to safetensors",
                [Command("cp -r + sync", f"cp -r {root}/save {cp_dst} && sync {cp_dst}/* {cp_dst}",
                         setup=clear(cp_dst), teardown=clear(cp_dst)),
                 Command("torch consolidate_safetensors_files", [sys.executable, "-c", CONSOLIDATE,
                                                                 str(root / "save"), str(torch_out), str(mapping)],
                         setup=clear(torch_out), teardown=clear(torch_out)),
                 Command("ckptctl export", [*CKPTCTL, "export", str(root / "save"), str(ours), "--max-shard-size", "500MB",
                                            "-q"], setup=clear(ours), teardown=clear(ours))],
                prepare=partial(make, root), prefault=2 * SPEC.size + 2**29)


CASES = [_case()]


def _worker(src: Path, root: Path) -> None:
    """One rank: the checkpoint's tensors, 2-D ones as this rank's rows of a ``Shard(0)`` DTensor,
    saved by ``HuggingFaceStorageWriter`` into ``root/save``."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state, mapping = {}, {}
    for i, f in enumerate(sorted(src.glob("*.safetensors"))):
        for name, t in load_file(f).items():
            mapping[name] = i + 1
            if t.dim() == 2 and t.shape[0] >= world:
                rows = t.chunk(world, dim=0)[rank].contiguous()  # Shard(0)'s split
                state[name] = DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=t.shape,
                                                 stride=t.stride())
            else:
                state[name] = t
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(root / "save"), save_distributed=True))
    if rank == 0:
        (root / "mapping.json").write_text(json.dumps(mapping))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
