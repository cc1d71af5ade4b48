"""A waiting DCP save's ``.metadata`` is parsed once per version of the file (follow/metacache.py),
and every judgement made through the cache equals the reference's (read at every look)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ckptctl.follow.completion import judge
from ckptctl.follow.metacache import MetadataCache
from ckptctl.follow.saves import Save, fingerprint
from tests.test_follow_dcp import Loop


def _both(save: Save, cache: MetadataCache, quiet_s: float = 3600.0):
    fp = fingerprint(save.path)
    now = time.time_ns()
    cached = judge(save, fp, now_ns=now, quiet_s=quiet_s, cache=cache)
    reference = judge(save, fp, now_ns=now, quiet_s=quiet_s)
    assert cached == reference
    return cached


def test_metadata_read_once_per_version_and_the_same_judgement(tmp_path: Path) -> None:
    loop = Loop(tmp_path / "run")
    path = loop.save(1)
    save, cache = Save("dcp", "step-1", 1, path), MetadataCache()
    for _ in range(5):  # waiting for its quiet period: five looks, one read
        judged = _both(save, cache)
        assert not judged.complete and "quiet period" in judged.reason
    assert cache.reads == 1
    first = _both(save, cache, quiet_s=0).identity
    loop.save(1)  # saved again: a new .metadata (another inode, time, save id)
    again = _both(save, cache, quiet_s=0)
    assert cache.reads == 2 and again.complete and again.identity["save_id"] != first["save_id"]
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    with open(data, "r+b") as f:  # a rank's file shorter than .metadata says: the cached needs see it
        f.truncate(os.path.getsize(data) // 2)
    judged = _both(save, cache, quiet_s=0)
    assert not judged.complete and "reads up to" in judged.reason and cache.reads == 2


def test_the_cache_is_bounded_and_can_be_switched_off(tmp_path: Path, monkeypatch) -> None:
    loop = Loop(tmp_path / "run")
    cache = MetadataCache(limit=1)
    for step in (1, 2, 3):
        _both(Save("dcp", f"step-{step}", step, loop.save(step)), cache)
    assert len(cache.entries) == 1 and cache.reads == 3
    monkeypatch.setenv("CKPTCTL_FAST_FOLLOW_METADATA", "0")
    assert MetadataCache.if_enabled() is None
    monkeypatch.delenv("CKPTCTL_FAST_FOLLOW_METADATA")
    assert isinstance(MetadataCache.if_enabled(), MetadataCache)
