"""Pickles zero-copy: a ``torch.save`` archive stores each storage uncompressed at a known offset,
so export copies contiguous same-dtype tensors straight from the archive with the kernel. Every
file it writes must be byte for byte what the streaming path writes (the same tensors handed over
in memory, where no file range exists), and the offsets must agree with what
``torch.load(weights_only=True, mmap=True)`` maps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptctl.api import save_state_dict
from ckptctl.errors import InputError
from ckptctl.format import dtypes as dt
from ckptctl.sources.torch_archive import read_archive
from ckptctl.sources.torch_source import load_pickle
from tests.support import run_ckptctl


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    sd = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.w": torch.randn(16, 48, generator=g).to(torch.bfloat16),
        "model.layers.0.h": torch.randn(33, generator=g).half(),
        "model.layers.0.ids": torch.arange(17, dtype=torch.int64),
        "model.layers.0.mask": torch.rand(9, generator=g) > 0.5,
        "model.layers.0.fp8": torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn),
        "model.empty": torch.zeros(0, 4),
    }
    big = torch.randn(40, 12, generator=g)
    sd["model.layers.1.slice"] = big[5:20]  # a contiguous view at a storage offset
    sd["model.layers.1.rest"] = big[20:]
    sd["model.layers.1.t"] = torch.randn(12, 10, generator=g).t()  # not contiguous: streams
    return sd


def _export_json(*args: object) -> dict:
    proc = run_ckptctl("export", *args, "--json", check=True)
    return json.loads(proc.stdout)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.parametrize("shards", [1, 3])
def test_archive_copy_equals_streaming(tmp_path, shards):
    sd = _state()
    src = tmp_path / "src"
    src.mkdir()
    names = list(sd)
    if shards == 1:
        torch.save(sd, src / "pytorch_model.bin")
    else:
        wm = {}
        for i in range(shards):
            part = {k: sd[k] for k in names[i::shards]}
            fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            torch.save(part, src / fname)
            wm.update(dict.fromkeys(part, fname))
        (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    doc = _export_json(src, tmp_path / "fast", "--max-shard-size", "4KB")
    contiguous = sum(t.numel() * t.element_size() for t in sd.values() if t.is_contiguous())
    assert doc["bytes_copied_by_kernel"] + doc["bytes_cloned"] == contiguous
    assert doc["bytes_streamed"] == sd["model.layers.1.t"].numel() * 4

    loaded = {}
    for f in sorted(src.glob("*.bin")):
        loaded.update(torch.load(f, weights_only=True))  # in memory: no file ranges, every byte streamed
    slow = save_state_dict(loaded, tmp_path / "slow", max_shard_size="4KB")
    assert slow.bytes_streamed == sum(t.numel() * t.element_size() for t in sd.values())
    assert len(list((tmp_path / "fast").glob("*.safetensors"))) > 1
    _same_files(tmp_path / "fast", tmp_path / "slow")


def test_dtype_conversion_streams_and_matches(tmp_path):
    sd = _state()
    (tmp_path / "src").mkdir()
    torch.save(sd, tmp_path / "src" / "pytorch_model.bin")
    doc = _export_json(tmp_path / "src", tmp_path / "fast", "--dtype", "fp16")
    converted = sum(t.numel() * 2 for t in sd.values() if t.dtype in (torch.float32, torch.bfloat16))
    assert doc["bytes_streamed"] >= converted
    slow = tmp_path / "slow"
    save_state_dict(torch.load(tmp_path / "src" / "pytorch_model.bin", weights_only=True), slow, dtype="fp16")
    _same_files(tmp_path / "fast", slow)


def test_offsets_agree_with_torch_mmap(tmp_path):
    """The records (read without torch) say where each contiguous tensor's bytes are; every byte
    there is what ``torch.load(weights_only=True, mmap=True)`` gives for it."""
    sd = _state()
    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path)
    records = read_archive(path, None)
    mapped = load_pickle(path, None)
    assert list(records) == list(mapped) == list(sd)
    offsets = {k: r.offset for k, r in records.items() if r.offset is not None}
    assert set(offsets) == {k for k, t in sd.items() if t.is_contiguous() and t.numel()}
    raw = path.read_bytes()
    for k, r in records.items():
        t = mapped[k]
        assert (r.shape, r.dtype) == (tuple(t.shape), dt.from_torch(t.dtype).name), k
        if r.offset is not None:
            n = t.numel() * t.element_size()
            assert raw[r.offset:r.offset + n] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), k


def test_a_truncated_archive_is_refused_without_torch(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(InputError, match="not a readable torch checkpoint .damaged zip archive"):
        read_archive(path, None)


def test_keep_writes_one_safetensors_per_pickle_shard(tmp_path):
    """``--max-shard-size keep`` groups by the file a tensor is stored in: each pickle shard's
    tensors (contiguous ones copied, the transposed view streamed) become one safetensors shard."""
    from safetensors.torch import load_file

    sd = _state()
    src = tmp_path / "src"
    src.mkdir()
    names = list(sd)
    wm = {}
    for i in range(2):
        part = {k: sd[k] for k in names[i::2]}
        fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save(part, src / fname)
        wm.update(dict.fromkeys(part, fname))
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    _export_json(src, tmp_path / "out", "--max-shard-size", "keep")
    for i in range(2):
        got = load_file(tmp_path / "out" / f"model-{i + 1:05d}-of-00002.safetensors")
        assert set(got) == set(names[i::2])
        for k, v in got.items():
            assert torch.equal(v.view(torch.uint8), sd[k].contiguous().view(torch.uint8)), k
