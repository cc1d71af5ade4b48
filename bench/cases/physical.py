"""The physical reference: what copying, reading and hashing the bytes of a checkpoint costs.

Other cases reuse :func:`reference_commands` to put the same floor beside their own commands.
"""

from __future__ import annotations

import shlex
from functools import partial
from pathlib import Path

from bench.gen import WORK, Spec, ensure
from bench.harness import Case, Command, clear

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)


def reference_commands(src: Path, tag: str) -> list[Command]:
    """``cp -r`` (page cache only), ``cp -r`` + fsync of the copy, ``cat``, ``sha256sum``."""
    dst = WORK / "out" / f"{tag}-cp"
    s, d = shlex.quote(str(src)), shlex.quote(str(dst))
    clean = clear(dst)
    return [
        Command("cp -r", ["cp", "-r", str(src), str(dst)], setup=clean, teardown=clean),
        Command("cp -r + sync", f"cp -r {s} {d} && sync {d}/* {d}", setup=clean, teardown=clean),
        Command("cat > /dev/null", f"cat {s}/*"),
        Command("sha256sum", f"sha256sum {s}/*.safetensors"),
    ]


_src = WORK / SPEC.name()
CASES = [
    Case("physical", f"{SPEC.name()}: copy, read and hash every byte with coreutils",
         reference_commands(_src, "physical"), prepare=partial(ensure, SPEC), prefault=SPEC.size + 2**29),
]
