"""Export of a DeepSpeed ZeRO-2 and a ZeRO-3 checkpoint (2 GB of fp32 master weights each, 2
ranks) to safetensors, as ratios to ``cp`` + ``sync`` of the rank files that hold those weights,
beside DeepSpeed's own ``zero_to_fp32.py`` (the script ``save_checkpoint`` leaves in the root).

The checkpoints are made by DeepSpeed itself (this module run as a 2-rank Gloo job on the CPU
accelerator, ``DS_BUILD_OPS=0``): a Llama-shaped model (``bench.gen.shape_for``) initialised,
wrapped by ``deepspeed.initialize`` and saved at once, HF Trainer layout (``checkpoint-1/{config.json, latest,
global_step1/}``). ``CKPTCTL_BENCH_ZERO_SIZE`` (e.g. ``500MB``) makes a smaller pair, for a quick
run on a busy machine; the directory names say the size.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

from bench.gen import WORK, shape_for
from bench.harness import CKPTCTL, Case, Command, clear
from ckptctl.sizes import parse_size

SIZE = parse_size(os.environ.get("CKPTCTL_BENCH_ZERO_SIZE", "2GB"))  # bytes of fp32 master weights
WORLD = 2


def root_of(stage: int) -> Path:
    return WORK / f"zero{stage}-{SIZE // 10**6}MB-fp32" / "checkpoint-1"


def make(stage: int) -> None:
    """The checkpoint of ``stage`` (built once: a ``done`` stamp beside it)."""
    root = root_of(stage)
    stamp = root.parent / "done.json"
    if stamp.exists():
        return
    clear(root.parent)()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.cases.zero", str(root), str(stage), str(SIZE)],
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                       WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(WORLD),
                                       DS_ACCELERATOR="cpu", DS_BUILD_OPS="0"))
             for r in range(WORLD)]
    if any(p.wait() for p in procs):
        raise RuntimeError(f"building the ZeRO-{stage} checkpoint failed")
    stamp.write_text(json.dumps({"stage": stage, "size": SIZE}))


def _case(stage: int) -> Case:
    root = root_of(stage)
    folder = root / "global_step1"
    tag = f"zero{stage}"
    cp_dst, ours, bf16, z2f = (WORK / "out" / f"{tag}-{x}" for x in ("cp", "ckptctl", "bf16", "zero_to_fp32"))
    return Case(f"zero{stage}-export", f"ZeRO-{stage}, {SIZE / 1e9:.2f} GB of fp32 master weights on 2 ranks: "
                                       "to safetensors",
                [Command("cp rank files + sync", f"mkdir -p {cp_dst} && cp {folder}/*_optim_states.pt {cp_dst}/ "
                                                 f"&& sync {cp_dst}/* {cp_dst}", setup=clear(cp_dst), teardown=clear(cp_dst)),
                 Command("zero_to_fp32.py", [sys.executable, str(root / "zero_to_fp32.py"), str(root), str(z2f),
                                             "--safe_serialization"], setup=clear(z2f), teardown=clear(z2f)),
                 Command("ckptctl export", [*CKPTCTL, "export", str(root), str(ours), "-q"], setup=clear(ours),
                         teardown=clear(ours)),
                 Command("ckptctl export --dtype bf16", [*CKPTCTL, "export", str(root), str(bf16), "--dtype", "bf16",
                                                        "-q"], setup=clear(bf16), teardown=clear(bf16))],
                prepare=partial(make, stage), prefault=3 * SIZE + 2**29)


CASES = [_case(2), _case(3)]


def _worker(root: Path, stage: int, size: int) -> None:
    """One rank: a model of ``size`` bytes of fp32 parameters, wrapped and saved at once."""
    import deepspeed
    import deepspeed.ops
    import torch
    import transformers

    deepspeed.ops.__dict__["__compatible_ops__"] = {"deepspeed_shm_comm": False}  # no JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    cfg_dict = shape_for(size // 4).config("F32")
    cfg = transformers.LlamaConfig(**{k: v for k, v in cfg_dict.items() if k != "torch_dtype"})
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 10**7, "allgather_bucket_size": 10**7}}
    # (not under ``deepspeed.zero.Init``: with torch 2.13 it fails, "Signature mismatch" of Parameter.__new__)
    model = transformers.LlamaForCausalLM(cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds)
    engine.save_checkpoint(str(root), tag="global_step1")
    if torch.distributed.get_rank() == 0:
        (root / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
