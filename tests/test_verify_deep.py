"""--deep: exact NaN/Inf/zero detection for every float format, across any chunk boundary, with a
bounded buffer, on a second thread; sha256 equal to hashlib's over the whole file. Each runs on the
reference (``scan_file``) and on the fast path (``scan_files``, one worker and two)."""

from __future__ import annotations

import hashlib
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ckptctl.format.header import read_header
from ckptctl.verify.deep import DeepResult, scan_file, scan_files
from tests.support import write_raw_safetensors as _write

torch = pytest.importorskip("torch")


def _torch_bytes(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[int, int, bool]]]:
    """A file with every decodable float format, odd sizes, an unaligned start, known specials."""
    g = torch.Generator().manual_seed(0)
    want: dict[str, tuple[int, int, bool]] = {}  # name -> (nan, inf, all_zero)
    tensors: list[tuple[str, str, tuple[int, ...], bytes]] = [("mask", "U8", (3,), b"\x01\x00\x01")]
    specs = [("f32", torch.float32, "F32"), ("f16", torch.float16, "F16"), ("bf16", torch.bfloat16, "BF16"),
             ("f64", torch.float64, "F64"), ("e5m2", torch.float8_e5m2, "F8_E5M2"),
             ("e4m3", torch.float8_e4m3fn, "F8_E4M3")]
    for i, (name, tdt, st) in enumerate(specs):
        t = (torch.randn(37, 29, generator=g) + 0.5).to(tdt).to(torch.float32)
        flat = t.view(-1)
        nan_at = torch.randperm(flat.numel(), generator=g)[: 3 + i]
        flat[nan_at] = float("nan")
        inf_n = 0
        if st != "F8_E4M3":  # e4m3fn has no infinity
            inf_at = torch.randperm(flat.numel(), generator=g)[:50]
            inf_at = inf_at[~torch.isnan(flat[inf_at])][: 2 + i]
            flat[inf_at[: len(inf_at) // 2]] = float("inf")
            flat[inf_at[len(inf_at) // 2:]] = float("-inf")
            inf_n = len(inf_at)
        tt = t.to(tdt)
        back = tt.to(torch.float32)
        want[name] = (int(torch.isnan(back).sum()), int(torch.isinf(back).sum()), False)
        assert want[name][1] == inf_n
        tensors.append((name, st, tuple(t.shape), _torch_bytes(tt)))
        tensors.append((name + "_pad", "U8", (i + 1,), b"\x07" * (i + 1)))  # shifts the next start
    neg_zero = torch.zeros(5, 7, dtype=torch.bfloat16) * -1.0
    tensors.append(("negzero", "BF16", (5, 7), _torch_bytes(neg_zero)))
    want["negzero"] = (0, 0, True)
    path = tmp_path_factory.mktemp("deep") / "mixed.safetensors"
    _write(path, tensors)
    return path, want


WAYS = ["reference", "scan_files-reference", "fast-1", "fast-2"]


def scan(way: str, path: Path, hdr, **kw) -> DeepResult:
    """One file scanned ``way``: scan_file itself, or scan_files (fast=False, or fast on 1 or 2 workers)."""
    if way == "reference":
        return scan_file(str(path), str(path), hdr, **kw)
    kw.pop("progress", None)
    fast, workers = (False, 2) if way == "scan_files-reference" else (True, int(way[-1]))
    (res,) = scan_files([(str(path), str(path), hdr, 0)], fast=fast, workers=workers, **kw)
    assert isinstance(res, DeepResult), res
    return res


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("chunk", [64, 100, 1001, 4096, 8 << 20])
def test_counts_are_exact_at_every_chunk_size(mixed, chunk: int, way: str) -> None:
    path, want = mixed
    hdr = read_header(path)
    assert hdr.ok and any(f.code == "header.unaligned_tensor" for f in hdr.findings)
    res = scan(way, path, hdr, chunk_bytes=chunk)
    got: dict[str, list] = {n: [0, 0, False] for n in want}
    for f in res.findings:
        if f.tensor in got:
            if f.code == "deep.nan":
                got[f.tensor][0] = f.details["count"]
            elif f.code == "deep.inf":
                got[f.tensor][1] = f.details["count"]
            elif f.code == "deep.all_zero":
                got[f.tensor][2] = True
    assert {k: tuple(v) for k, v in got.items()} == want
    assert res.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert res.bytes_read == path.stat().st_size


def test_memory_stays_bounded_and_decoding_runs_on_a_second_thread(tmp_path: Path) -> None:
    """A 48 MB file scanned with 1 MiB chunks: peak Python/numpy memory stays a few MB."""
    from safetensors.numpy import save_file

    a = np.random.default_rng(0).standard_normal((3072, 1024)).astype(np.float32)  # 12 MB
    save_file({f"w{i}": a for i in range(4)}, str(tmp_path / "big.safetensors"), metadata={"format": "pt"})
    del a
    path = tmp_path / "big.safetensors"
    hdr = read_header(path)
    seen: set[str] = set()

    def progress(n: int) -> None:
        seen.update(t.name for t in threading.enumerate())

    tracemalloc.start()
    try:
        res = scan_file(str(path), str(path), hdr, chunk_bytes=1 << 20, progress=progress)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.bytes_read == path.stat().st_size > 48_000_000
    assert peak < 12 * (1 << 20), f"peak traced memory {peak} bytes"
    assert "ckptctl-verify-decode" in seen
    assert not res.findings


def test_fast_path_memory_stays_bounded(tmp_path: Path) -> None:
    """The same 48 MB file on the fast path, one worker and two: a few windows, nothing per file size."""
    from safetensors.numpy import save_file

    a = np.random.default_rng(0).standard_normal((3072, 1024)).astype(np.float32)
    save_file({f"w{i}": a for i in range(4)}, str(tmp_path / "big.safetensors"), metadata={"format": "pt"})
    del a
    path = tmp_path / "big.safetensors"
    hdr = read_header(path)
    for workers in (1, 2):
        tracemalloc.start()
        try:
            (res,) = scan_files([(str(path), str(path), hdr, 0)], chunk_bytes=8 << 20, workers=workers)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert isinstance(res, DeepResult) and res.bytes_read == path.stat().st_size and not res.findings
        assert res.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert peak < 8 * (1 << 20), f"peak traced memory {peak} bytes"


@pytest.mark.parametrize("way", WAYS)
def test_invalid_header_is_hashed_but_not_decoded(tmp_path: Path, way: str) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    res = scan(way, p, read_header(p), chunk_bytes=64)
    assert res.sha256 == hashlib.sha256(p.read_bytes()).hexdigest() and not res.findings


@pytest.mark.parametrize("way", WAYS)
def test_a_small_file_does_not_pay_for_full_size_buffers(tmp_path: Path, way: str) -> None:
    """The read buffers are no larger than the file: a 4 KiB shard read with the default 8 MiB
    chunk allocates kilobytes, not three 8 MiB buffers (on a corpus of small files that zeroing
    was most of --deep's time)."""
    path = tmp_path / "small.safetensors"
    _write(path, [("w", "F32", (32, 32), np.ones((32, 32), np.float32).tobytes())])
    hdr = read_header(path)
    tracemalloc.start()
    try:
        res = scan(way, path, hdr)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.bytes_read == path.stat().st_size and not res.findings
    assert res.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert peak < 1 << 20, f"peak traced memory {peak} bytes"


def _flip_in_record(path, suffix: str) -> None:
    """Flip one bit in the data of the archive's record ending with ``suffix`` (a real torch.save
    file: stored records, the local header before each)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        rec = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    raw = bytearray(path.read_bytes())
    lh = rec.header_offset
    n, m = struct.unpack("<HH", raw[lh + 26:lh + 30])
    raw[lh + 30 + n + m + 41] ^= 0x40
    path.write_bytes(bytes(raw))


def test_deep_checks_the_crc32_of_every_record_of_a_bin(tmp_path, run_cli):
    import json

    import torch

    good = tmp_path / "good"
    good.mkdir()
    torch.save({"model.embed.weight": torch.arange(1000, dtype=torch.float32).reshape(100, 10)},
               good / "pytorch_model.bin")
    (good / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 10}))
    rc, out, err = run_cli("verify", "--deep", "--json", good)
    codes = {f["code"] for c in json.loads(out)["results"] for f in c["findings"]}
    assert "deep.zip_crc_mismatch" not in codes, out
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in good.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    _flip_in_record(bad / "pytorch_model.bin", "data/0")
    assert torch.load(bad / "pytorch_model.bin")["model.embed.weight"].flatten()[10] != 10  # loads, changed
    rc, out, err = run_cli("verify", "--json", bad)
    assert rc == 0, out  # the static checks cannot see it
    rc, out, err = run_cli("verify", "--deep", "--json", bad)
    found = [f for c in json.loads(out)["results"] for f in c["findings"] if f["code"] == "deep.zip_crc_mismatch"]
    assert rc == 1 and len(found) == 1 and found[0]["severity"] == "error", out
    assert found[0]["code"] == "deep.zip_crc_mismatch" and "data/0" in found[0]["message"]
