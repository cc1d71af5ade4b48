"""``ckptctl resave``: a repair that must write no tensor bytes, re-sharding beside ``cp -r``, and
dtype conversion beside huggingface_hub (load, convert, ``save_torch_state_dict``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

from bench.cases.physical import reference_commands
from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command, clear

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)
TINY = Spec(tiny_shards=1000, layers=1000)
FP32 = Spec(size=10**9, dtype="fp32", shards=2)

HUB_BF16 = ("import os, sys, glob, torch; from safetensors.torch import load_file; "
            "from huggingface_hub import save_torch_state_dict as s; sd = {}; "
            "[sd.update({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}) "
            "for f in sorted(glob.glob(sys.argv[1] + '/*.safetensors'))]; os.makedirs(sys.argv[2]); "
            "s(sd, sys.argv[2], max_shard_size='5GB')")


def damaged_copy(src: Path, dst: Path) -> None:
    """A hard-linked copy of ``src`` with a wrong index (total_size) and a stale extra shard."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)
    idx_path = dst / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["metadata"]["total_size"] = 1
    os.unlink(idx_path)  # a hard link: never write through it
    idx_path.write_text(json.dumps(idx))
    shards = sorted(p for p in dst.glob("model-*.safetensors"))
    os.link(shards[0], dst / shards[0].name.replace(f"-of-{len(shards):05d}", "-of-00008"))  # an older export's


def linked_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)


def _cases() -> list[Case]:
    src, tiny, fp32 = WORK / SPEC.name(), WORK / TINY.name(), WORK / FP32.name()
    rep, rep_tiny = WORK / "out" / "repair", WORK / "out" / "repair-tiny"
    resh = WORK / "out" / "reshard"
    conv, hub = WORK / "out" / "bf16", WORK / "out" / "bf16-hub"
    return [
        Case("resave-repair", f"{SPEC.name()} and {TINY.name()}: --repair of a wrong index and a stale shard",
             [Command("ckptctl resave --repair (4 shards, 2 GB)", [*CKPTCTL, "resave", "--repair", str(rep), "-q"],
                      setup=partial(damaged_copy, src, rep), teardown=clear(rep)),
              Command("ckptctl resave --repair (1000 shards)", [*CKPTCTL, "resave", "--repair", str(rep_tiny), "-q"],
                      setup=partial(damaged_copy, tiny, rep_tiny), teardown=clear(rep_tiny))],
             prepare=lambda: (ensure(SPEC), ensure(TINY))),
        Case("resave-reshard", f"{SPEC.name()}: re-shard in place into 1 GB shards",
             [*reference_commands(src, "reshard"),
              Command("ckptctl resave --max-shard-size 1GB", [*CKPTCTL, "resave", str(resh), "--max-shard-size",
                                                              "1GB", "-q"],
                      setup=partial(linked_copy, src, resh), teardown=clear(resh))],
             prepare=partial(ensure, SPEC), reference="cp -r + sync", prefault=2 * SPEC.size + 2**29),
        Case("resave-bf16", f"{FP32.name()}: fp32 to bf16",
             [Command("ckptctl resave --dtype bf16 --output", [*CKPTCTL, "resave", str(fp32), "--dtype", "bf16",
                                                                "--output", str(conv), "-q"],
                      setup=clear(conv), teardown=clear(conv)),
              Command("hub load + to(bf16) + save_torch_state_dict", [sys.executable, "-c", HUB_BF16, str(fp32),
                                                                      str(hub)], setup=clear(hub), teardown=clear(hub))],
             prepare=partial(ensure, FP32), prefault=2 * FP32.size + 2**29),
    ]


CASES = _cases()
