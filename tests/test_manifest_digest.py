"""``--manifest`` hashes each shard while it is written (``write/digest.py``): bytes that pass
through Python from memory, kernel-copied and cloned ranges read back from the shard. Every
digest taken that way must be the sha256 of the published file, on every write path (kernel copy,
streamed conversion, both mixed in one shard, a pickle source, an index and extras hashed from
memory); an out-of-order write falls back to reading the file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from ckptctl.manifest import MANIFEST_NAME
from ckptctl.write.digest import ShardDigest
from ckptctl.write.inputs import open_inputs
from ckptctl.write.job import ExportJob
from ckptctl.write.options import ExportOptions
from tests.support import run_ckptctl, state, write_config, write_pickle, write_sharded


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


def test_kernel_copied_shards_index_and_extras_hashed_while_written(tmp_path):
    src = tmp_path / "src"
    write_sharded(src, state(1, n=8), per_shard=3)
    write_config(src)
    taken, doc = _staged_digests(src, tmp_path / "out", max_shard_size="20KB")
    shards = sorted(n for n in doc["files"] if n.endswith(".safetensors"))
    assert len(shards) > 2
    assert set(taken) == set(shards) | {"model.safetensors.index.json", "config.json"}  # nothing read back whole
    _check(tmp_path / "out", taken, doc)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_streamed_and_kernel_copied_tensors_in_one_shard(tmp_path, dtype):
    src = tmp_path / "src"
    write_sharded(src, _mixed_state(), per_shard=5)
    taken, doc = _staged_digests(src, tmp_path / "out", dtype=dtype, chunk_bytes=256)
    assert "model.safetensors" in taken
    _check(tmp_path / "out", taken, doc)


def test_pickle_source_hashed_while_written(tmp_path):
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


def test_shard_digest_in_order_from_memory_and_from_the_file(tmp_path):
    data = os.urandom(10_000)
    fd = _file(tmp_path, data)
    try:
        d = ShardDigest(fd)
        d.written(0, data[:100])  # header: from memory
        d.final(100, 4000)  # a kernel copy: read back
        d.written(4100, data[4100:5000])  # streamed after it: the copy is read first
        d.written(5000, data[5000:6000])
        d.final(4100, 1900)
        d.final(6000, 4000)
        assert d.finish(10_000) == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)


def test_shard_digest_never_guesses(tmp_path):
    data = os.urandom(5000)
    fd = _file(tmp_path, data)
    try:
        gap = ShardDigest(fd)
        gap.written(0, data[:100])
        gap.final(200, 4800)  # [100, 200) never written
        assert gap.finish(5000) is None
        short = ShardDigest(fd)
        short.final(0, 4000)
        assert short.finish(5000) is None  # not every byte is final
        beyond = ShardDigest(fd)
        beyond.final(0, 6000)  # the file is shorter than what was written
        assert beyond.finish(6000) is None
        # a stream that resumes after a partial kernel copy is not next in order: read back
        resumed = ShardDigest(fd)
        resumed.written(0, data[:10])
        resumed.written(2000, b"x" * 100)  # ignored: [10, 2000) is not final yet
        resumed.final(10, 4990)
        assert resumed.finish(5000) == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)
