"""Default ``verify`` (headers, configs and the model class built on the meta device in its box;
not ``--static``, not ``--deep``) of one small checkpoint and of ten in one call (issue 45): ten
4 MB single-file Llama checkpoints of 1 to 10 layers, so each has its own config and the class
check builds ten models. Beside a raw stdlib scan of the same ten headers (the reference: open,
read the 8-byte length and the header, ``json.loads`` it), hashlib's sha256 of every byte of the
ten (what a byte-reading check would pay), and ``import torch, transformers`` (the imports the
class check pays once per call)."""

from __future__ import annotations

import sys

from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command

SPECS = [Spec(size=4 * 10**6, single=True, layers=n) for n in range(1, 11)]
RAW_SCAN = ("import sys, os, json, struct\n"
            "for d in sys.argv[1:]:\n"
            "    for n in sorted(os.listdir(d)):\n"
            "        if n.endswith('.safetensors'):\n"
            "            with open(os.path.join(d, n), 'rb') as f:\n"
            "                json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))\n")
HASH = ("import sys, os, hashlib\n"
        "for d in sys.argv[1:]:\n"
        "    for n in sorted(os.listdir(d)):\n"
        "        with open(os.path.join(d, n), 'rb') as f:\n"
        "            hashlib.file_digest(f, 'sha256')\n")


def _prepare() -> None:
    for spec in SPECS:
        ensure(spec)


def _cases() -> list[Case]:
    dirs = [str(WORK / spec.name()) for spec in SPECS]
    return [
        Case("verify-default", "default verify (model class included) of one 4 MB checkpoint and of ten in one call",
             [Command("raw stdlib header scan (10)", [sys.executable, "-c", RAW_SCAN, *dirs]),
              Command("hashlib sha256 (10)", [sys.executable, "-c", HASH, *dirs]),
              Command("import torch, transformers", [sys.executable, "-c", "import torch, transformers"]),
              Command("ckptctl verify (1)", [*CKPTCTL, "verify", dirs[0], "-q"]),
              Command("ckptctl verify (10, one call)", [*CKPTCTL, "verify", *dirs, "-q"])],
             prepare=_prepare),
    ]


CASES = _cases()
