"""What export and a no-op repair cost beyond their floor, and what ``--manifest`` adds.

``metadata-write``: DeepSeek-V3's 91,991 tensor names in 163 shards (about 20 MB of data):
``ckptctl export`` beside ``cp -r`` + ``sync`` of the same directory (the data part of an
export: issue 16's target is export <= 1 s + that), and a no-op ``resave --repair`` beside the
raw stdlib header scan (target <= 3x). ``manifest-write``: a 2 GB checkpoint exported with and
without ``--manifest`` (shards hashed while they are written) beside ``sha256sum`` of its files
and ``cp -r`` + ``sync``."""

from __future__ import annotations

import shlex
import sys
from functools import partial

from bench.cases.metadata import RAW_SCAN
from bench.cases.metadata import SPEC as MOE
from bench.cases.physical import SPEC as DENSE
from bench.cases.resave import linked_copy
from bench.gen import WORK, ensure
from bench.harness import CKPTCTL, Case, Command, clear


def _cp_sync(src, dst) -> Command:
    s, d = shlex.quote(str(src)), shlex.quote(str(dst))
    return Command("cp -r + sync", f"cp -r {s} {d} && sync {d}/* {d}", setup=clear(dst), teardown=clear(dst))


def _export(name: str, src, out, *extra: str) -> Command:
    return Command(name, [*CKPTCTL, "export", str(src), str(out), "-q", *extra], setup=clear(out), teardown=clear(out))


def _cases() -> list[Case]:
    moe, dense = WORK / MOE.name(), WORK / DENSE.name()
    out, rep = WORK / "out" / "mw-export", WORK / "out" / "mw-repair"
    return [
        Case("metadata-write", f"{MOE.name()}: export and a no-op repair of 91,991 tensors beside their floors",
             [_cp_sync(moe, WORK / "out" / "mw-cp"),
              Command("raw stdlib header scan", [sys.executable, "-c", RAW_SCAN, str(moe)]),
              _export("ckptctl export", moe, out),
              _export("ckptctl export --manifest", moe, out, "--manifest"),
              Command("ckptctl resave --repair (no-op)", [*CKPTCTL, "resave", "--repair", str(rep), "-q", "--static"],
                      setup=partial(linked_copy, moe, rep), teardown=clear(rep), optional=("--static",))],
             prepare=partial(ensure, MOE)),
        Case("manifest-write", f"{DENSE.name()}: export --manifest (hashed while written) against export and sha256sum",
             [_export("ckptctl export", dense, out),
              _export("ckptctl export --manifest", dense, out, "--manifest"),
              Command("sha256sum", f"sha256sum {shlex.quote(str(dense))}/*.safetensors"),
              _cp_sync(dense, WORK / "out" / "mw-cp")],
             prepare=partial(ensure, DENSE), prefault=2 * DENSE.size + 2**29),
    ]


CASES = _cases()
