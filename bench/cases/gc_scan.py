"""``ckptctl gc-tmp`` over a tree of 10,000 entries: 25 runs x 49 checkpoints (7 files each), with
25 dead writers' staging directories and 25 stale ``*.incomplete`` downloads among them.

Commands: ``find`` walking the same tree (the floor for looking at every entry), ``gc-tmp
--dry-run`` (scan and judge every candidate: owner record, lock probe, pid check, tree size), and
``gc-tmp`` removing the 50 leftovers (recreated, untimed, before each run).

    python -m bench.run --case gc-scan-10k
    python -m bench.cases.gc_scan            # just build the tree and time one in-process scan
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from bench.gen import WORK
from bench.harness import CKPTCTL, Case, Command

TREE = WORK / "gc-tree-10k"
RUNS, STEPS = 25, 49
FILES = ("config.json", "tokenizer.json", "model.safetensors.index.json",
         *(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)))
LEAKS = 25  # dead staging directories, and as many stale .incomplete files
ENTRIES = 10_000
STAMP = TREE.with_suffix(".stamp.json")
VERSION = 1


def _dead_owner() -> dict:
    """An owner record of a writer on this host that is dead (a reaped child: pid gone or reused
    with another start time)."""
    from ckptctl import staging

    p = subprocess.Popen(["true"])
    start = None
    for _ in range(1000):
        start = staging.process_start_time(p.pid)
        if start is not None:
            break
    p.wait()
    record = staging.owner_record(TREE / "x", "bench writer")
    record.update(pid=p.pid, start_time=start)
    return record


def plant_leaks() -> None:
    """(Re)create the 25 dead staging directories and 25 stale downloads, 5 entries / 1 each."""
    from ckptctl import staging

    owner = _dead_owner()
    old = time.time() - 86400
    for r in range(LEAKS):
        run = TREE / f"run_{r:02d}"
        for p in run.iterdir():
            if staging.parse_name(p.name) or p.name.endswith(".incomplete"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        d = run / staging.staging_name(f"step_{STEPS:03d}")
        (d / staging.DATA).mkdir(parents=True)
        (d / staging.LOCK).touch()
        (d / staging.OWNER).write_text(json.dumps({**owner, "dest": f"step_{STEPS:03d}"}))
        (d / staging.DATA / "model-00001-of-00004.safetensors").write_bytes(b"\0" * 4096)
        (d / staging.DATA / "config.json").write_text("{}")
        leak = run / f"blob{r}.incomplete"
        leak.write_bytes(b"\0" * 1024)
        for p in (d / staging.DATA / "config.json", d / staging.DATA / "model-00001-of-00004.safetensors",
                  d / staging.DATA, d / staging.LOCK, d / staging.OWNER, d, leak):
            os.utime(p, (old, old), follow_symlinks=False)


def count_entries() -> int:
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(TREE))


def prepare() -> None:
    if STAMP.exists() and json.loads(STAMP.read_text()).get("version") == VERSION and TREE.is_dir():
        plant_leaks()
        return
    shutil.rmtree(TREE, ignore_errors=True)
    for r in range(RUNS):
        for s in range(STEPS):
            step = TREE / f"run_{r:02d}" / f"step_{s:03d}"
            step.mkdir(parents=True)
            for name in FILES:
                (step / name).touch()
    plant_leaks()
    n = count_entries()
    # top up to exactly ENTRIES with small files in the last run
    for i in range(ENTRIES - n):
        (TREE / f"run_{RUNS - 1:02d}" / f"notes_{i}.txt").touch()
    assert count_entries() == ENTRIES, count_entries()
    STAMP.write_text(json.dumps({"version": VERSION, "entries": ENTRIES}))


_GC = [*CKPTCTL, "gc-tmp"]
_ARGS = [str(TREE), "--preset", "incomplete", "--json"]
CASES = [
    Case("gc-scan-10k", f"gc-tmp over {ENTRIES:,} entries ({LEAKS} dead staging dirs + {LEAKS} stale downloads)",
         [Command("find (walk only)", ["find", str(TREE), "-name", "_tmp_*", "-prune", "-o", "-name", "*.incomplete",
                                       "-print"]),
          Command("gc-tmp --dry-run", [*_GC, *_ARGS, "--dry-run"]),
          Command("gc-tmp (removes 50)", [*_GC, *_ARGS], setup=plant_leaks)],
         prepare=prepare),
]


def main() -> int:
    from ckptctl import gc

    t = time.monotonic()
    prepare()
    print(f"tree: {count_entries():,} entries at {TREE} (built/refreshed in {time.monotonic() - t:.2f}s)",
          file=sys.stderr)
    opts = gc.GcOptions(presets=("incomplete",), dry_run=True)
    best = None
    for _ in range(5):
        res = gc.run([TREE], opts)
        best = res.seconds if best is None else min(best, res.seconds)
    leaked = len(res.leaked)
    print(f"gc-tmp scan (in-process, dry run, best of 5): {best * 1000:.1f} ms for {res.scanned:,} entries "
          f"looked at, {leaked} leftovers judged removable")
    t = time.monotonic()
    res = gc.run([TREE], gc.GcOptions(presets=("incomplete",)))
    print(f"gc-tmp removal (in-process): {time.monotonic() - t:.3f}s, removed {len(res.removed)}, "
          f"freed {res.bytes_freed:,} bytes")
    plant_leaks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
