"""``--manifest`` hashes each shard while it is written (``write/digest.py``): bytes that pass
through Python from memory, kernel-copied and cloned ranges read back from the shard. Every
digest taken that way must be the sha256 of the published file, on every write path (kernel copy,
streamed conversion, both mixed in one shard, a pickle source, an index and extras hashed from
memory); an out-of-order write falls back to reading the file. Every test runs with the read-back
at the end (the reference, ``early=False``), with the early reader (the default) and with an early
reader that starts at the first final byte."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from ckptctl.manifest import MANIFEST_NAME
from ckptctl.threads import Stopped
from ckptctl.write import shards as shards_module
from ckptctl.write.digest import ShardDigest
from ckptctl.write.inputs import open_inputs
from ckptctl.write.job import ExportJob
from ckptctl.write.options import ExportOptions
from tests.support import run_ckptctl, state, write_config, write_pickle, write_sharded


MODES = {"reference": {"early": False}, "early": {}, "early-always": {"early_bytes": 1}}


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The writer's digests made with each mode's arguments."""
    monkeypatch.setattr(shards_module, "ShardDigest", functools.partial(ShardDigest, **MODES[request.param]))
    return MODES[request.param]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _staged_digests(src: Path, dst: Path, **opts) -> tuple[dict[str, tuple[int, str]], dict]:
    """Run the export's steps; the digests the writer took and the published manifest."""
    with open_inputs(src, dst, ExportOptions(manifest=True, **opts)) as inputs:
        job = ExportJob(inputs, dst)
        job.prepare(place=True)
        data = job.stage()
        try:
            job.write_shards(data)
            job.finalize()
            taken = job.written_digests()
            job.publish()
        except BaseException:
            job.abort()
            raise
    return taken, json.loads((dst / MANIFEST_NAME).read_text())


def _check(dst: Path, taken: dict[str, tuple[int, str]], doc: dict) -> None:
    files = sorted(p.name for p in dst.iterdir() if p.name != MANIFEST_NAME)
    assert sorted(doc["files"]) == files
    for name in files:
        p = dst / name
        assert doc["files"][name] == {"size": p.stat().st_size, "sha256": _sha(p)}, name
    for name, (size, digest) in taken.items():
        assert (size, digest) == (os.path.getsize(dst / name), _sha(dst / name)), name


def _mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for i in range(6):  # floats (converted with --dtype) between integers (kept: kernel copies)
        out[f"model.layers.{i}.a.weight"] = torch.randn(33, 17, generator=g)
        out[f"model.layers.{i}.b.ids"] = torch.arange(i * 50, i * 50 + 41, dtype=torch.int64)
    out["model.empty"] = torch.zeros(0, 3)
    return out


def test_kernel_copied_shards_index_and_extras_hashed_while_written(tmp_path, mode):
    src = tmp_path / "src"
    write_sharded(src, state(1, n=8), per_shard=3)
    write_config(src)
    taken, doc = _staged_digests(src, tmp_path / "out", max_shard_size="20KB")
    shards = sorted(n for n in doc["files"] if n.endswith(".safetensors"))
    assert len(shards) > 2
    assert set(taken) == set(shards) | {"model.safetensors.index.json", "config.json"}  # nothing read back whole
    _check(tmp_path / "out", taken, doc)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_streamed_and_kernel_copied_tensors_in_one_shard(tmp_path, dtype, mode):
    src = tmp_path / "src"
    write_sharded(src, _mixed_state(), per_shard=5)
    taken, doc = _staged_digests(src, tmp_path / "out", dtype=dtype, chunk_bytes=256)
    assert "model.safetensors" in taken
    _check(tmp_path / "out", taken, doc)


def test_pickle_source_hashed_while_written(tmp_path, mode):
    src = tmp_path / "src"
    src.mkdir()
    sd = _mixed_state()
    sd["model.strided"] = torch.randn(12, 10).t()  # not contiguous: streamed
    write_pickle(src, sd)
    taken, doc = _staged_digests(src, tmp_path / "out")
    assert "model.safetensors" in taken
    _check(tmp_path / "out", taken, doc)


def test_cli_manifest_equals_sha256_of_every_published_file(tmp_path):
    src = tmp_path / "src"
    write_sharded(src, _mixed_state(), per_shard=4)
    for extra in ([], ["--dtype", "bf16"]):
        out = tmp_path / f"out{len(extra)}"
        run_ckptctl("export", str(src), str(out), "--manifest", "--max-shard-size", "4KB", *extra, "-q", check=True)
        doc = json.loads((out / MANIFEST_NAME).read_text())
        _check(out, {}, doc)
        run_ckptctl("verify", str(out), check=True)
    rep = tmp_path / "rep"
    write_sharded(rep, _mixed_state(), per_shard=4)
    run_ckptctl("resave", str(rep), "--manifest", "--max-shard-size", "3KB", "-q", check=True)
    _check(rep, {}, json.loads((rep / MANIFEST_NAME).read_text()))


def _file(tmp_path: Path, data: bytes) -> int:
    p = tmp_path / "f"
    p.write_bytes(data)
    return os.open(p, os.O_RDONLY)


@pytest.mark.parametrize("kw", MODES.values(), ids=MODES)
def test_shard_digest_in_order_from_memory_and_from_the_file(tmp_path, kw):
    data = os.urandom(10_000)
    fd = _file(tmp_path, data)
    try:
        d = ShardDigest(fd, **kw)
        d.written(0, data[:100])  # header: from memory
        d.final(100, 4000)  # a kernel copy: read back
        d.written(4100, data[4100:5000])  # streamed after it: the copy is read first
        d.written(5000, data[5000:6000])
        d.final(4100, 1900)
        d.final(6000, 4000)
        assert d.finish(10_000) == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)


@pytest.mark.parametrize("kw", MODES.values(), ids=MODES)
def test_shard_digest_never_guesses(tmp_path, kw):
    data = os.urandom(5000)
    fd = _file(tmp_path, data)
    try:
        gap = ShardDigest(fd, **kw)
        gap.written(0, data[:100])
        gap.final(200, 4800)  # [100, 200) never written
        assert gap.finish(5000) is None
        short = ShardDigest(fd, **kw)
        short.final(0, 4000)
        assert short.finish(5000) is None  # not every byte is final
        beyond = ShardDigest(fd, **kw)
        beyond.final(0, 6000)  # the file is shorter than what was written
        assert beyond.finish(6000) is None
        # a stream that resumes after a partial kernel copy is not next in order: read back
        resumed = ShardDigest(fd, **kw)
        resumed.written(0, data[:10])
        resumed.written(2000, b"x" * 100)  # ignored: [10, 2000) is not final yet
        resumed.final(10, 4990)
        assert resumed.finish(5000) == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)


def test_early_reader_hashes_behind_the_writer_and_lets_streamed_bytes_be_read_back(tmp_path):
    """A 24 MiB file made final range by range (as kernel copies finish), streamed pieces between
    them: the early reader starts once 16 MiB wait, reads while the writer goes on, and finish
    reads only what is left; the digest equals the reference's and hashlib's."""
    data = os.urandom(24 << 20)
    fd = _file(tmp_path, data)
    try:
        seen: set[str] = set()
        d = ShardDigest(fd)
        d.written(0, data[:4096])
        at = 4096
        for step in (5 << 20, 7 << 20, 6 << 20):  # kernel copies: 18 MiB final after the third
            d.final(at, step)
            at += step
            seen.update(t.name for t in threading.enumerate())
        for piece in range(4):  # streamed behind them: hashed from memory or read back
            d.written(at, data[at:at + 65536])
            d.final(at, 65536)
            at += 65536
        d.final(at, len(data) - at)
        assert "ckptctl-digest" in seen
        assert d.finish(len(data)) == hashlib.sha256(data).hexdigest()
        ref = ShardDigest(fd, early=False)
        ref.final(0, len(data))
        assert ref.finish(len(data)) == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)


def test_early_reader_stops_on_close_and_on_a_short_file(tmp_path):
    data = os.urandom(3 << 20)
    fd = _file(tmp_path, data)
    try:
        d = ShardDigest(fd, early_bytes=1)
        d.final(0, len(data))
        d.close()  # the writer failed: the reader stops, the descriptor is closed
        assert d.fd == -1 and d._reader is None
        short = ShardDigest(fd, early_bytes=1)
        short.final(0, len(data) + 100)  # more than the file holds
        assert short.finish(len(data) + 100) is None
        stop = threading.Event()
        stop.set()
        stopped = ShardDigest(fd, early_bytes=1 << 40)
        stopped.final(0, len(data))
        with pytest.raises(Stopped):
            stopped.finish(len(data), stop)
        assert stopped.fd == -1
    finally:
        os.close(fd)


def test_a_shared_gate_bounds_the_early_readers(tmp_path):
    data = os.urandom(2 << 20)
    fd = _file(tmp_path, data)
    try:
        gate = threading.BoundedSemaphore(1)
        assert gate.acquire(blocking=False)  # another shard's reader holds it
        d = ShardDigest(fd, early_bytes=1, gate=gate)
        d.final(0, len(data))
        assert d._reader is None  # none started: finish reads it all
        gate.release()
        assert d.finish(len(data)) == hashlib.sha256(data).hexdigest()
        e = ShardDigest(fd, early_bytes=1, gate=gate)
        e.final(0, len(data))
        assert e.finish(len(data)) == hashlib.sha256(data).hexdigest()
        assert gate.acquire(blocking=False)  # given back when the reader ended
    finally:
        os.close(fd)


@pytest.mark.parametrize("kw", MODES.values(), ids=MODES)
def test_steps_of_a_copy_count_only_where_they_join_the_final_bytes(tmp_path, kw):
    """``progress`` (a step of a kernel copy) moves the final bytes on only where the step joins
    them: pieces of one tensor copied out of order are no gap (``final`` of the tensor decides
    after), and a step past a range not yet written is not counted."""
    data = os.urandom(20_000)
    fd = _file(tmp_path, data)
    try:
        d = ShardDigest(fd, **kw)
        d.written(0, data[:100])
        d.progress(5100, 4900)  # the second piece first: too early, not a gap
        d.progress(100, 5000)  # the first piece: joins
        d.final(100, 9900)  # the tensor is done
        d.progress(12_000, 3000)  # past [10_000, 12_000), which is not written yet: not counted
        d.final(10_000, 10_000)
        assert d.finish(20_000) == hashlib.sha256(data).hexdigest()
        half = ShardDigest(fd, **kw)
        half.progress(0, 20_000)
        assert half._final == 20_000 and half.finish(20_000) == hashlib.sha256(data).hexdigest()
        never = ShardDigest(fd, **kw)
        never.progress(50, 100)  # [0, 50) never final: nothing counts, and no gap is guessed
        assert never._final == 0 and not never._broken and never.finish(20_000) is None
    finally:
        os.close(fd)


def test_a_long_kernel_copy_is_hashed_step_by_step_behind_it(tmp_path, monkeypatch):
    """One run longer than the copy step, no fsync: the copy goes in steps and the early reader
    starts during the run, not after it; the digest is still the published file's."""
    monkeypatch.setattr(shards_module, "WRITEBACK_STEP", 64 << 10)
    started_at: list[int] = []
    real = ShardDigest._maybe_follow

    def watch(self):
        before = self._reader
        real(self)
        if before is None and self._reader is not None:
            started_at.append(self._final)

    monkeypatch.setattr(ShardDigest, "_maybe_follow", watch)
    monkeypatch.setattr(shards_module, "ShardDigest", functools.partial(ShardDigest, early_bytes=128 << 10))
    src = tmp_path / "src"
    g = torch.Generator().manual_seed(3)
    write_sharded(src, {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)}, per_shard=4)  # 1 MiB, one run
    taken, doc = _staged_digests(src, tmp_path / "out", fsync=False)
    _check(tmp_path / "out", taken, doc)
    assert "model.safetensors" in taken
    assert started_at and started_at[0] < 1 << 20  # the reader followed the copy before the run ended
