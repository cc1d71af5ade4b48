"""A legal 90 MB header (issue 15's last item): 1,250,000 one-element BF16 tensors in one
``model.safetensors`` (2.5 MB of data), as ``safetensors`` writes it. ``ckptctl verify`` and
``inspect --json`` against the reference, a bare ``json.loads`` of the header (with the cyclic
collector off, as ckptctl parses), and ``verify`` with the fast header decoder off
(``CKPTCTL_FAST_METADATA=0``: the strict reader alone). Peak RSS is the point: a JSON tree of it
costs about 930 MiB."""

from __future__ import annotations

import json
import shlex
import sys
from functools import partial
from pathlib import Path

from bench.gen import WORK
from bench.harness import CKPTCTL, Case, Command

TENSORS = 1_250_000
_DIR = WORK / f"huge-header-{TENSORS}"
_FILE = _DIR / "model.safetensors"
JSON_LOADS = ("import gc, json, struct, sys\n"
              "gc.disable()\n"
              "with open(sys.argv[1], 'rb') as f:\n"
              "    json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))\n")


def ensure_huge(path: Path = _FILE, tensors: int = TENSORS) -> Path:
    """``path`` holding the header ``encode_header`` (byte-identical to safetensors' writer)
    gives ``l.0`` ... ``l.{tensors-1}``, and their zero bytes; made again when its stamp differs."""
    from ckptctl.format.header import encode_header
    from ckptctl.format.tensor import TensorSpec

    stamp = path.with_name(path.name + ".stamp.json")
    want = {"tensors": tensors, "dtype": "BF16", "shape": [1]}
    if path.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == want:
        return path
    print(f"generating {path} ...", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    head, infos = encode_header([TensorSpec(f"l.{i}", "BF16", (1,)) for i in range(tensors)])
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + infos[-1].end)
    stamp.write_text(json.dumps(want) + "\n")
    return path


CASES = [
    Case("huge-header", f"one file, {TENSORS:,} tensors: a 90 MB header",
         [Command("json.loads of the header", [sys.executable, "-c", JSON_LOADS, str(_FILE)]),
          Command("ckptctl verify", [*CKPTCTL, "verify", str(_FILE), "-q"]),
          Command("ckptctl verify (strict reader only)",
                  "CKPTCTL_FAST_METADATA=0 " + shlex.join([*CKPTCTL, "verify", str(_FILE), "-q"])),
          Command("ckptctl inspect --json", [*CKPTCTL, "inspect", str(_FILE), "--json"])],
         prepare=partial(ensure_huge, _FILE), prefault=1 << 30),
]
