"""Export of a multi-GB torch DCP checkpoint with 1 and 2 processes, as ratios to ``cp -r`` +
``sync`` of the DCP directory, beside torch's own ``dcp_to_torch_save``. (torch's
``_consolidate_hf_safetensors`` reads only DCP saved by ``HuggingFaceStorageWriter``, safetensors
shards, not the ``.distcp`` archives of the default ``FileSystemWriter``: it is no anchor here.)"""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

from bench.cases.physical import reference_commands
from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command, clear

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)
MAKE_DCP = ("import sys, glob, warnings; warnings.simplefilter('ignore'); "
            "import torch.distributed.checkpoint as dcp; from safetensors.torch import load_file; sd = {}; "
            "[sd.update(load_file(f)) for f in sorted(glob.glob(sys.argv[1] + '/*.safetensors'))]; "
            "dcp.save({'model': sd}, checkpoint_id=sys.argv[2], no_dist=True)")
TO_TORCH = ("import sys, warnings; warnings.simplefilter('ignore'); "
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])")


def make_dcp(dcp_dir: Path) -> None:
    src = ensure(SPEC)
    if (dcp_dir / ".metadata").exists():
        return
    clear(dcp_dir)()
    subprocess.run([sys.executable, "-c", MAKE_DCP, str(src), str(dcp_dir)], check=True)


def _cases() -> list[Case]:
    dcp_dir = WORK / f"{SPEC.name()}-dcp"
    one, two, pt = WORK / "out" / "dcp-1", WORK / "out" / "dcp-2", WORK / "out" / "dcp.pt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
                "-m", "ckptctl"]
    return [
        Case("dcp-export", f"{SPEC.name()} saved as torch DCP: to safetensors",
             [*(c for c in reference_commands(dcp_dir, "dcp") if c.name == "cp -r + sync"),
              Command("dcp_to_torch_save", [sys.executable, "-c", TO_TORCH, str(dcp_dir), str(pt)],
                      setup=clear(pt), teardown=clear(pt)),
              Command("ckptctl export (1 process)", [*CKPTCTL, "export", str(dcp_dir), str(one), "--key", "model",
                                                     "--max-shard-size", "1GB", "-q"], setup=clear(one),
                      teardown=clear(one)),
              Command("torchrun -n 2 ckptctl export", [*torchrun, "export", str(dcp_dir), str(two), "--key", "model",
                                                       "--max-shard-size", "1GB", "-q"], setup=clear(two),
                      teardown=clear(two))],
             prepare=partial(make_dcp, dcp_dir), prefault=2 * SPEC.size + 2**29),
    ]


CASES = _cases()
