"""``ckptctl inspect`` of a 1,000-shard checkpoint, beside huggingface_hub reading the same
headers and ``cat`` reading every byte."""

from __future__ import annotations

import shlex
import sys
from functools import partial

from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command

SPEC = Spec(tiny_shards=1000, layers=1000)  # 9,003 tensors, about 9 per shard, 82 MB in all
HF_READ = "import sys; from huggingface_hub import get_local_safetensors_metadata as g; g(sys.argv[1])"

_src = WORK / SPEC.name()
CASES = [
    Case("inspect-1000", f"{SPEC.name()}: read every header and the index",
         [Command("hf get_local_safetensors_metadata", [sys.executable, "-c", HF_READ, str(_src)]),
          Command("ckptctl inspect --json", [*CKPTCTL, "inspect", str(_src), "--json"]),
          Command("cat > /dev/null", f"cat {shlex.quote(str(_src))}/*.safetensors")],
         prepare=partial(ensure, SPEC)),
]
