"""``ckptctl export`` of a multi-GB checkpoint beside ``cp -r`` of the same files and
huggingface_hub (load every tensor, then ``save_torch_state_dict``)."""

from __future__ import annotations

import sys
from functools import partial

from bench.cases.physical import reference_commands
from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command, clear

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)
BIN = Spec(size=2 * 10**9, dtype="bf16", bin=True)

# huggingface_hub's way: materialise every tensor, then write (deletes the old files first).
HUB_SAVE = ("import os, sys, glob; from safetensors.torch import load_file; "
            "from huggingface_hub import save_torch_state_dict as s; sd = {}; "
            "[sd.update(load_file(f)) for f in sorted(glob.glob(sys.argv[1] + '/*.safetensors'))]; "
            "os.makedirs(sys.argv[2]); s(sd, sys.argv[2], max_shard_size='1GB')")
HUB_SAVE_BIN = ("import os, sys, torch; from huggingface_hub import save_torch_state_dict as s; "
                "sd = torch.load(sys.argv[1] + '/pytorch_model.bin', weights_only=True, mmap=True); "
                "os.makedirs(sys.argv[2]); s(sd, sys.argv[2], max_shard_size='1GB')")


def _cases() -> list[Case]:
    src = WORK / SPEC.name()
    out = WORK / "out" / "export"
    hub = WORK / "out" / "export-hub"
    c_out, c_hub = clear(out), clear(hub)
    bsrc = WORK / BIN.name()
    bout, bhub = WORK / "out" / "export-bin", WORK / "out" / "export-bin-hub"
    return [
        Case("export", f"{SPEC.name()}: same-dtype export into 1 GB shards (re-sharded, fsynced, published)",
             [*reference_commands(src, "export"),
              Command("ckptctl export", [*CKPTCTL, "export", str(src), str(out), "--max-shard-size", "1GB", "-q"],
                      setup=c_out, teardown=c_out),
              Command("ckptctl export --no-fsync", [*CKPTCTL, "export", str(src), str(out), "--max-shard-size",
                                                    "1GB", "-q", "--no-fsync"], setup=c_out, teardown=c_out),
              Command("hub load + save_torch_state_dict", [sys.executable, "-c", HUB_SAVE, str(src), str(hub)],
                      setup=c_hub, teardown=c_hub)],
             prepare=partial(ensure, SPEC), reference="cp -r + sync", prefault=2 * SPEC.size + 2**29),
        Case("export-bin", f"{BIN.name()}: pytorch_model.bin to safetensors",
             [*(c for c in reference_commands(bsrc, "export-bin") if c.name == "cp -r + sync"),
              Command("ckptctl export", [*CKPTCTL, "export", str(bsrc), str(bout), "--max-shard-size", "1GB", "-q"],
                      setup=clear(bout), teardown=clear(bout)),
              Command("hub torch.load + save_torch_state_dict", [sys.executable, "-c", HUB_SAVE_BIN, str(bsrc),
                                                                 str(bhub)], setup=clear(bhub), teardown=clear(bhub))],
             prepare=partial(ensure, BIN), reference="cp -r + sync", prefault=2 * BIN.size + 2**29),
    ]


CASES = _cases()
