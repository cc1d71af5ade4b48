"""Exports on a cloning filesystem (a loop-mounted XFS image, ``mkfs.xfs -m reflink=1``; root
only) beside ``cp -r`` (coreutils 9 reflinks by default): a same-layout export
(``--max-shard-size keep``: every shard a whole-file clone) and a re-shard (each output shard
clones its largest run of source bytes). Each command's extra space (used blocks after it, minus
before, after ``sync``) and the result's cloned / copied / streamed bytes are printed to stderr
as it runs, and as a table at the end of the case (teardown of the last command)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command, clear

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)
IMAGE = WORK / "xfs-reflink.img"
MNT = WORK / "xfs-reflink"
SRC = MNT / SPEC.name()
SPACE: dict[str, list[float]] = {}


def _used() -> int:
    os.sync()
    st = os.statvfs(MNT)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def mount_and_generate() -> None:
    """Mount the XFS image (created once, 3x the checkpoint) and generate the source on it."""
    if not os.path.ismount(MNT):
        MNT.mkdir(parents=True, exist_ok=True)
        if not IMAGE.exists():
            with open(IMAGE, "wb") as f:
                f.truncate(3 * SPEC.size + (1 << 30))
            subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(IMAGE)], check=True)
        subprocess.run(["mount", "-o", "loop", str(IMAGE), str(MNT)], check=True)
    ensure(SPEC, SRC)


def _space_hooks(label: str, out: Path, json_out: bool) -> tuple:
    before: list[int] = []
    wipe = clear(out)

    def setup() -> None:
        wipe()
        before[:] = [_used()]

    def teardown() -> None:
        extra = _used() - before[0]
        size = sum(p.stat().st_size for p in SRC.iterdir() if p.is_file())
        SPACE.setdefault(label, []).append(100 * extra / size)
        note = ""
        if json_out and (out.parent / f"{out.name}.json").exists():
            doc = json.loads((out.parent / f"{out.name}.json").read_text())
            note = (f"; cloned {doc['bytes_cloned']:,} B, kernel {doc['bytes_copied_by_kernel']:,} B, "
                    f"streamed {doc['bytes_streamed']:,} B")
        print(f"  {label}: extra space {extra / 2**20:,.1f} MiB ({100 * extra / size:.2f}% of the source){note}",
              file=sys.stderr, flush=True)
        wipe()

    return setup, teardown


def _command(label: str, tag: str, args: list[str] | None) -> Command:
    out = MNT / "out" / tag
    setup, teardown = _space_hooks(label, out, args is not None)
    if args is None:
        argv: list[str] | str = f"cp -r {shlex.quote(str(SRC))} {shlex.quote(str(out))} && sync"
    else:
        report = shlex.quote(str(out.parent / f"{out.name}.json"))
        argv = " ".join(shlex.quote(a) for a in [*CKPTCTL, "export", str(SRC), str(out), *args, "--json"]) + f" > {report}"
    return Command(label, argv, setup=setup, teardown=teardown)


CASES = [
    Case("reflink", f"{SPEC.name()} on loop XFS (reflink=1): same-layout export and re-shard vs cp -r",
         [_command("cp -r + sync", "cp", None),
          _command("ckptctl export keep", "keep", ["--max-shard-size", "keep"]),
          _command("ckptctl export 1GB (re-shard)", "reshard", ["--max-shard-size", "1GB"])],
         prepare=partial(mount_and_generate), prefault=0),
]
