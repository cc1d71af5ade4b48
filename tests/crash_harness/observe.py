"""What a trial looks at: the staging directories a writer left, whether each is attributable,
where a killed writer was, and whether a version is clean (I1: verify and every loader; I2: the
manifest and the index agree with the files)."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

from tests.support import INDEX, LOADERS, MANIFEST, differences, process_state, sha256, staging_dirs
from tests.support import snapshot as _tree_snapshot

DEST = "ckpt"
DECOY = "_tmp_ckpt.0000000000000001-00000000"  # matches the staging name pattern, no owner record


def snapshot(root: Path, skip: Callable[[str], bool] | None = None) -> dict[str, str]:
    """:func:`tests.support.snapshot` with manifests compared without their ``created`` stamp: the
    new version is what a clean run produces, and two clean runs differ only there."""
    return _tree_snapshot(root, skip, ignore_manifest_stamp=True)


def our_staging(ws: Path) -> list[Path]:
    """Entries of ``ws`` that look like staging (``_tmp_*``), except the foreign decoy."""
    return [p for p in staging_dirs(ws) if p.name != DECOY]


def is_stub(d: Path) -> bool:
    """Nothing inside but empty ``lock``/``owner.json`` (gc-tmp's definition of a stub)."""
    try:
        names = os.listdir(d)
        return set(names) <= {"lock", "owner.json"} and all(
            (d / n).is_file() and not (d / n).is_symlink() and (d / n).stat().st_size == 0 for n in names)
    except OSError:
        return False


def attributable(d: Path, dest_name: str = DEST) -> str | None:
    """Why ``d`` is not an attributable staging directory of ``dest_name`` (None when it is)."""
    from ckptctl import staging

    parsed = staging.parse_name(d.name)
    if not parsed or parsed[0] != dest_name:
        return f"{d.name}: not a staging name for {dest_name}"
    if not d.is_dir() or d.is_symlink():
        return f"{d.name}: not a directory"
    owner = staging.read_owner(d)
    if owner is None:
        # an empty stub (killed between mkdir and the owner record, or at the end of the cleanup)
        # is recognised by gc-tmp too
        return None if is_stub(d) else f"{d.name}: no owner record"
    if owner.get("dest") != dest_name:
        return f"{d.name}: owner record names {owner.get('dest')!r}"
    return None


def infer_phase(ws: Path) -> str:
    """Where a randomly killed writer was, judged from what it left."""
    st = our_staging(ws)
    if not st:
        return "before-staging-or-done"
    d = st[-1]
    names = set(os.listdir(d))
    if "old" in names:
        return "two-rename"
    if "ready" in names:
        return "sealed"
    if "data" not in names:
        return "staging"
    data = set(os.listdir(d / "data"))
    if not os.path.lexists(ws / DEST) or "owner.json" not in names:
        return "cleanup"
    if MANIFEST in data or INDEX in data or "config.json" in data:
        return "finalize"
    if any(n.endswith(".safetensors") for n in data):
        return "writing"
    return "staged"


def check_version(d: Path, expected: dict) -> list[str]:
    """I1 for a version that must be clean: verify finds no error; every loader sees ``expected``."""
    from ckptctl.findings import ERROR
    from ckptctl.verify import verify_path

    problems = []
    res = verify_path(d)
    errors = [f"{f.code}: {f.message}" for f in res.findings if f.severity == ERROR]
    if errors:
        problems.append(f"verify: {errors[:3]}")
    for name, loader in LOADERS.items():
        try:
            got = loader(d)
        except (SafetensorError, OSError, ValueError, KeyError) as exc:  # the loader refuses: a finding
            problems.append(f"{name} loader failed: {type(exc).__name__}: {exc}")
            continue
        diff = differences(got, expected, limit=2)
        if diff:
            problems.append(f"{name} loader sees different tensors: {diff}")
    return problems


def check_marker(d: Path) -> list[str]:
    """I2: the manifest (if any) lists every file with its exact size and sha256, and nothing is
    unlisted; the index's weight_map equals the union of the shard headers."""
    problems = []
    m = d / MANIFEST
    if m.exists():
        doc = json.loads(m.read_bytes())
        files = doc["files"]
        for name, e in files.items():
            p = d / name
            if not p.is_file():
                problems.append(f"manifest lists {name}, which does not exist")
                continue
            if p.stat().st_size != e["size"]:
                problems.append(f"manifest size of {name} is wrong")
            elif sha256(p.read_bytes()) != e["sha256"]:
                problems.append(f"manifest sha256 of {name} is wrong")
        present = {os.path.relpath(os.path.join(dp, f), d) for dp, _, fs in os.walk(d) for f in fs} - {MANIFEST}
        if present != set(files):
            problems.append(f"manifest does not list {sorted(present - set(files))} / lists extra "
                            f"{sorted(set(files) - present)}")
    if (d / INDEX).exists():
        wm = json.loads((d / INDEX).read_text())["weight_map"]
        union: dict[str, str] = {}
        for shard in sorted(set(wm.values())):
            for name in header_names(d / shard):
                union[name] = shard
        if union != wm:
            problems.append("index weight_map differs from the union of the shard headers")
    return problems


def header_names(path: Path) -> list[str]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    return [k for k in hdr if k != "__metadata__"]


def wait_for_staging(ws: Path, pid: int, timeout: float = 120) -> None:
    """Until the writer's staging directory exists (or the writer is gone): random kills are
    timed from there, so startup time and a busy machine do not move them out of the writes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any((d / "data").is_dir() for d in our_staging(ws)):
            return
        if process_state(pid) in (None, "Z"):
            return
        time.sleep(0.0005)
