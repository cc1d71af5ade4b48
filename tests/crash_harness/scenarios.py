"""The scenarios of the crash campaign: a destination's old version, maybe a source, and the
command that replaces it; the named fault points each reaches; and :class:`Prepared`, a
scenario's template plus its reference (what a clean run of the command produces)."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tests.crash_harness.observe import (DECOY, DEST, check_marker, check_version, our_staging, snapshot,
                                         wait_for_staging)
from tests.crash_harness.poller import dir_signature
from tests.support import INDEX, MANIFEST, load_hub, state, write_config, write_sharded, write_single

# Every named fault point, in the order a publish reaches them (docs/ARCHITECTURE.md).
ALL_POINTS = ["stage-create", "stage-created", "shard-start", "write-data", "write-chunk", "fsync-shard",
              "shards-written", "index", "extras-written", "manifest-written", "fsync-dir", "sealed",
              "publish", "rename-noreplace", "exchange", "two-rename-between", "published", "after-publish"]
# after these the new version is visible
PUBLISHED_POINTS = {"published", "after-publish"}


def model_state(seed: int, n: int = 6, rows: int = 64, cols: int = 32) -> dict:
    """:func:`tests.support.state` with transformers-like names (``model.layers.{i}.mlp.weight``)."""
    return state(seed, n, rows, cols, name="model.layers.{i}.mlp.weight")


def _write_manifest(d: Path) -> None:
    """The old version's manifest, as an earlier `--manifest` run wrote it."""
    from ckptctl.manifest import build_manifest, encode_manifest

    files = sorted(os.path.relpath(os.path.join(dp, f), d) for dp, _, fs in os.walk(d) for f in fs)
    (d / MANIFEST).write_bytes(encode_manifest(build_manifest(d, files, label="old")))


def _fsync_tree(root: Path) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


@dataclass
class Scenario:
    """A destination's old version, maybe a source, and the command that replaces it."""

    name: str
    description: str
    build_old: Callable[[Path], None] | None  # None: the destination does not exist yet
    build_src: Callable[[Path], None] | None  # export only
    args: list[str]  # after the command name; {src} and {dst} are substituted
    points: list[str]  # the fault points this command reaches (a kill there must happen)
    old_clean: bool = True  # the old version verifies clean and the loaders agree on it
    env: dict[str, str] = field(default_factory=dict)  # e.g. force the exchange-less fallback
    big: bool = False  # sized for random kills during data writes
    # the retry: the same command, plus these (a retry of an export to a new destination that got
    # past its publish must say --overwrite, or it is refused with exit 2: see docs/RELIABILITY.md)
    rerun_extra: list[str] = field(default_factory=list)

    def argv(self, src: Path, dst: Path) -> list[str]:
        return [a.replace("{src}", str(src)).replace("{dst}", str(dst)) for a in self.args]


def _finish_old(d: Path) -> None:
    """What every "old version" has beside its weights: config, a model card, a manifest."""
    write_config(d)
    (d / "README.md").write_text("old model card\n")
    _write_manifest(d)


def _weights(d: Path, tensors: dict, max_shard_size: int | None) -> None:
    if max_shard_size is None:
        write_single(d, tensors)
    else:
        write_sharded(d, tensors, max_shard_size=max_shard_size)


def old_version(seed: int, max_shard_size: int | None = None, **shape: int) -> Callable[[Path], None]:
    """An old destination: ``model_state(seed, **shape)`` in one file (or sharded by
    huggingface_hub), then a config, a model card and a manifest."""

    def build(d: Path) -> None:
        _weights(d, model_state(seed, **shape), max_shard_size)
        _finish_old(d)

    return build


def source(seed: int, max_shard_size: int | None = None, **shape: int) -> Callable[[Path], None]:
    """An export source: the weights and a config."""

    def build(d: Path) -> None:
        _weights(d, model_state(seed, **shape), max_shard_size)
        write_config(d)

    return build


BIG = dict(n=8, rows=1024, cols=1024)  # 8 x 4 MiB fp32
_old_sharded, _old_single = old_version(1, 20_000), old_version(1)
_src_single, _src_sharded = source(2), source(2, 20_000)
_old_small_single, _src_big = old_version(1, n=2), source(3, **BIG)
_old_big_single, _old_big_sharded = old_version(4, **BIG), old_version(5, 9_000_000, **BIG)


def _old_needs_repair(d: Path) -> None:
    """What crashed tools leave: a wrong total_size, trailing bytes after a shard's data, a stale
    shard of another save beside the family, a safetensors temp file; no manifest."""
    write_sharded(d, model_state(1), max_shard_size=20_000)
    write_config(d)
    (d / "README.md").write_text("old model card\n")
    idx = json.loads((d / INDEX).read_text())
    idx["metadata"]["total_size"] = 1
    (d / INDEX).write_text(json.dumps(idx, indent=2))
    with open(d / "model-00002-of-00003.safetensors", "ab") as f:
        f.write(b"\0" * 100)
    shutil.copy(d / "model-00001-of-00003.safetensors", d / "model-00001-of-00004.safetensors")
    (d / ".tmpXyZ123").write_bytes(b"partial")


_COMMON = ["stage-create", "stage-created", "shard-start", "write-data", "fsync-shard", "shards-written",
           "extras-written", "manifest-written", "fsync-dir", "sealed", "publish", "exchange", "published",
           "after-publish"]
EINVAL = {"CKPTCTL_FAIL_AT": "exchange:EINVAL"}  # the filesystem cannot exchange: journaled two-rename
_FALLBACK_POINTS = ["sealed", "two-rename-between", "published", "after-publish"]

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("export-sharded-to-single", "export --overwrite: 3 shards + index -> one file (kernel copy)",
             _old_sharded, _src_single, ["export", "{src}", "{dst}", "--overwrite", "--manifest"], _COMMON),
    Scenario("export-single-to-sharded", "export --overwrite: one file -> 3 shards + index",
             _old_single, _src_sharded,
             ["export", "{src}", "{dst}", "--overwrite", "--manifest", "--max-shard-size", "20KB"],
             _COMMON[:6] + ["index"] + _COMMON[6:]),
    Scenario("export-new-destination", "export to a destination that does not exist yet",
             None, _src_sharded, ["export", "{src}", "{dst}", "--manifest", "--max-shard-size", "20KB"],
             ["stage-created", "write-data", "index", "sealed", "publish", "rename-noreplace", "published",
              "after-publish"], rerun_extra=["--overwrite"]),
    Scenario("export-two-rename", "export --overwrite where RENAME_EXCHANGE is refused (EINVAL, as on NFS)",
             _old_sharded, _src_single, ["export", "{src}", "{dst}", "--overwrite", "--manifest"],
             _FALLBACK_POINTS, env=EINVAL),
    Scenario("resave-dtype", "resave --dtype bf16 in place: 3 fp32 shards -> one bf16 file (streamed)",
             _old_sharded, None, ["resave", "{dst}", "--dtype", "bf16", "--manifest"],
             _COMMON[:4] + ["write-chunk"] + _COMMON[4:]),
    Scenario("resave-repair", "resave --repair in place: stale shard, temp file, trailing bytes, bad total",
             _old_needs_repair, None, ["resave", "{dst}", "--repair", "--manifest"],
             _COMMON[:6] + ["index"] + _COMMON[6:], old_clean=False),
    Scenario("resave-two-rename", "resave --dtype bf16 where RENAME_EXCHANGE is refused",
             _old_sharded, None, ["resave", "{dst}", "--dtype", "bf16", "--manifest"], _FALLBACK_POINTS,
             env=EINVAL),
    # sized for random kills while data is written (32 MiB of fp32)
    Scenario("big-export-bf16", "export --overwrite --dtype bf16 of 32 MiB into 4 MB shards (streamed)",
             _old_small_single, _src_big,
             ["export", "{src}", "{dst}", "--overwrite", "--dtype", "bf16", "--max-shard-size", "4MB",
              "--manifest"], ["write-chunk", "fsync-shard", "published"], big=True),
    Scenario("big-resave-reshard", "resave --max-shard-size 9MB of a 32 MiB single file (kernel copy)",
             _old_big_single, None, ["resave", "{dst}", "--max-shard-size", "9MB", "--manifest"],
             ["write-data", "fsync-shard", "published"], big=True),
    Scenario("big-resave-bf16", "resave --dtype bf16 of 32 MiB in 4 shards (streamed)",
             _old_big_sharded, None, ["resave", "{dst}", "--dtype", "bf16", "--manifest"],
             ["write-chunk", "fsync-shard", "published"], big=True),
    Scenario("big-export-two-rename", "big-export-bf16 where RENAME_EXCHANGE is refused",
             _old_small_single, _src_big,
             ["export", "{src}", "{dst}", "--overwrite", "--dtype", "bf16", "--max-shard-size", "4MB",
              "--manifest"], ["two-rename-between"], env=EINVAL, big=True),
]}


class Prepared:
    """A scenario's template (old destination, source) and its reference: what a clean run of the
    command produces, its tensors, and the poller signatures of both versions."""

    def __init__(self, scn: Scenario, root: Path, runner: Any) -> None:
        self.scn = scn
        self.root = root
        tpl = root / "template"
        (tpl / "ws").mkdir(parents=True)
        if scn.build_src:
            scn.build_src(tpl / "src")
        if scn.build_old:
            scn.build_old(tpl / "ws" / DEST)
        write_single(tpl / "ws" / "other", model_state(9, n=2))  # a bystander checkpoint
        (tpl / "ws" / "other" / "notes.txt").write_text("not ckptctl's\n")
        (tpl / "ws" / DECOY).mkdir()
        (tpl / "ws" / DECOY / "state.bin").write_bytes(b"another tool's staging\n")
        _fsync_tree(tpl)
        self.template = tpl
        self.old_snapshot = snapshot(tpl / "ws" / DEST)
        self.old_absent = scn.build_old is None
        self.old_tensors = load_hub(tpl / "ws" / DEST) if scn.old_clean and not self.old_absent else None
        self.old_sig = dir_signature(tpl / "ws" / DEST) if not self.old_absent else None
        # the clean run
        ref = self.instantiate(root / "reference")
        env = {k: v for k, v in scn.env.items()}
        r = runner.run(scn.argv(ref.src, ref.dst), env=env)
        if r.rc != 0:
            raise RuntimeError(f"clean run of {scn.name} failed ({r.rc}): {r.stderr[-3000:]}")
        self.clean_seconds = r.seconds
        self.new_snapshot = snapshot(ref.dst)
        self.new_tensors = load_hub(ref.dst)
        self.new_sig = dir_signature(ref.dst)
        problems = check_version(ref.dst, self.new_tensors) + check_marker(ref.dst)
        if problems:
            raise RuntimeError(f"clean run of {scn.name} is not clean: {problems}")
        if our_staging(ref.ws):
            raise RuntimeError(f"clean run of {scn.name} left staging behind")
        shutil.rmtree(ref.base)
        # how long a clean run lives after its staging directory appears: random kills aim there
        self.staged_seconds = self.clean_seconds
        if scn.big:
            spans = []
            for _ in range(3):
                ref = self.instantiate(root / "reference")
                h = runner.start(scn.argv(ref.src, ref.dst), env=dict(scn.env))
                wait_for_staging(ref.ws, h.pid)
                t = time.monotonic()
                if h.wait().rc != 0:
                    raise RuntimeError(f"clean run of {scn.name} failed")
                spans.append(time.monotonic() - t)
                shutil.rmtree(ref.base)
            self.staged_seconds = sorted(spans)[1]

    @dataclass
    class Paths:
        base: Path
        src: Path
        ws: Path
        dst: Path

    def instantiate(self, base: Path) -> "Prepared.Paths":
        if base.exists():
            shutil.rmtree(base)
        shutil.copytree(self.template, base, symlinks=True)
        return Prepared.Paths(base, base / "src", base / "ws", base / "ws" / DEST)

    def versions(self) -> dict[str, tuple[str, str, str]]:
        out = {"new": self.new_sig}
        if self.old_sig is not None:
            out["old"] = self.old_sig
        return out
