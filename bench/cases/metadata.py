"""Metadata at scale: DeepSeek-V3's 91,991 tensor names in 163 shards (about 20 MB of data), read
by ``verify --static``, ``inspect --json``, a no-op ``resave --repair --static`` and ``export``
(``--static``: the metadata path without the model-class check, which the ``model-class`` case
measures; a revision before that check runs without the flag), beside a raw stdlib
scan of the same headers (the reference: open, read the 8-byte length and the header, ``json.loads``
it, for every shard) and safetensors' ``safe_open`` of every key. ``help``: ``ckptctl --help``,
and ``verify`` of a 4 MB checkpoint (what a command pays before and after its work: its imports,
Typer's parsing of its options) and ``export`` of ``examples/tiny-llama`` (a command's fixed cost:
its imports, the source-kind probes, a publish of a few KB), against a bare ``import typer, rich``
(the start-up every command pays)."""

from __future__ import annotations

import sys
from functools import partial

from bench.cases.resave import linked_copy
from bench.gen import WORK, MoeSpec, Spec, ensure
from bench.revisions import ROOT
from bench.harness import CKPTCTL, Case, Command, clear

SPEC = MoeSpec()
SMALL = Spec(size=4 * 10**6, single=True)
RAW_SCAN = ("import sys, os, json, struct\n"
            "d = sys.argv[1]\n"
            "for n in sorted(os.listdir(d)):\n"
            "    if n.endswith('.safetensors'):\n"
            "        with open(os.path.join(d, n), 'rb') as f:\n"
            "            json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))\n")
SAFE_OPEN = ("import sys, glob\nfrom safetensors import safe_open\n"
             "for p in sorted(glob.glob(sys.argv[1] + '/*.safetensors')):\n"
             "    with safe_open(p, 'np') as f:\n"
             "        [f.get_slice(k) for k in f.keys()]\n")


def _cases() -> list[Case]:
    src = WORK / SPEC.name()
    out, rep = WORK / "out" / "moe-export", WORK / "out" / "moe-repair"
    tiny = WORK / "out" / "tiny-export"
    return [
        Case("metadata-moe", f"{SPEC.name()}: every header, the index and the plan of 91,991 tensors",
             [Command("raw stdlib header scan", [sys.executable, "-c", RAW_SCAN, str(src)]),
              Command("safe_open every key", [sys.executable, "-c", SAFE_OPEN, str(src)]),
              Command("ckptctl verify", [*CKPTCTL, "verify", str(src), "-q", "--static"], optional=("--static",)),
              Command("ckptctl inspect --json", [*CKPTCTL, "inspect", str(src), "--json"]),
              Command("ckptctl resave --repair (no-op)", [*CKPTCTL, "resave", "--repair", str(rep), "-q", "--static"],
                      setup=partial(linked_copy, src, rep), teardown=clear(rep), optional=("--static",)),
              Command("ckptctl export", [*CKPTCTL, "export", str(src), str(out), "-q"],
                      setup=clear(out), teardown=clear(out))],
             prepare=partial(ensure, SPEC)),
        Case("help", "start-up: ckptctl --help and a small verify against importing its two libraries",
             [Command("import typer, rich", [sys.executable, "-c", "import typer, rich"]),
              Command("ckptctl --help", [*CKPTCTL, "--help"]),
              Command("ckptctl verify (4 MB)", [*CKPTCTL, "verify", str(WORK / SMALL.name()), "-q", "--static"],
                      optional=("--static",)),
              Command("ckptctl export (tiny-llama)", [*CKPTCTL, "export", str(ROOT / "examples" / "tiny-llama"),
                                                      str(tiny), "-q"], setup=clear(tiny), teardown=clear(tiny))],
             prepare=partial(ensure, SMALL)),
    ]


CASES = _cases()
