"""Reflink-aware writing on a real cloning filesystem: a loop-mounted XFS image (``mkfs.xfs -m
reflink=1``), and btrfs where ``mkfs.btrfs`` is installed. Shared extents are read with
``filefrag -v`` (FIEMAP), free space with ``statvfs``, and every fast path is compared byte for
byte with the plain path on the test's own filesystem (ext4 or tmpfs: no cloning there)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from ckptctl.api import export
from ckptctl.format.header import encode_header, read_header
from ckptctl.plan import Run, runs
from ckptctl.write.options import ExportOptions
from ckptctl.write.files import link_or_copy
from tests.support.builders import INDEX, state, tiny_llama, write_pickle, write_sharded, write_single
from tests.support.loaders import load_glob, load_hub, load_single_first, load_with_transformers, same


def _mount(kind: str, base: Path) -> Path:
    mkfs = {"xfs": ["mkfs.xfs", "-q", "-m", "reflink=1"], "btrfs": ["mkfs.btrfs", "-q"]}[kind]
    if shutil.which(mkfs[0]) is None:
        pytest.skip(f"{mkfs[0]} is not installed (apt-get install {'xfsprogs' if kind == 'xfs' else 'btrfs-progs'})")
    img, mnt = base / f"{kind}.img", base / kind
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(512 << 20)
    subprocess.run([*mkfs, str(img)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mounting a loop {kind} image was refused: {r.stderr.strip()}")
    return mnt


@pytest.fixture(scope="session", params=["xfs", "btrfs"])
def cloning_fs(request, tmp_path_factory) -> Path:
    """A fresh cloning filesystem, mounted for the session and unmounted at its end."""
    mnt = _mount(request.param, tmp_path_factory.mktemp(f"loop-{request.param}"))
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True, capture_output=True)


@pytest.fixture
def clone_dir(cloning_fs: Path, request) -> Path:
    d = cloning_fs / request.node.name.replace("[", "-").replace("]", "")
    d.mkdir()
    yield d
    shutil.rmtree(d)


def shared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents flagged ``shared`` by FIEMAP (``filefrag -v``)."""
    out = subprocess.run(["filefrag", "-v", "-b1", str(path)], check=True, capture_output=True, text=True).stdout
    total = 0
    for line in out.splitlines():
        cols = line.split(":")
        if len(cols) >= 5 and cols[0].strip().isdigit() and "shared" in cols[-1]:
            total += int(cols[3])  # length, in bytes with -b1
    return total


def used_bytes(mnt: Path) -> int:
    os.sync()
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def parsed(path: Path) -> tuple[dict, bytes, bytes]:
    """(header JSON, raw header text, data section) of a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8:8 + n], raw[8 + n:]


def big_state() -> dict[str, torch.Tensor]:
    # 8 x 600 KiB fp32 plus odd-sized bf16 tensors: runs that start off any block boundary
    t = state(3, n=8, rows=512, cols=300)
    t.update(state(4, n=3, rows=37, cols=11, dtype=torch.bfloat16, name="small.{i}.bias"))
    return t


def opts(mss: str, **kw) -> ExportOptions:
    return ExportOptions(max_shard_size=mss, **kw)


def test_keep_layout_clones_every_shard_whole(clone_dir: Path, cloning_fs: Path, tmp_path: Path) -> None:
    src = clone_dir / "src"
    write_sharded(src, big_state(), max_shard_size="2MB")
    shards = sorted(src.glob("model-*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    before = used_bytes(cloning_fs)
    r = export(str(src), str(clone_dir / "out"), opts("keep"))
    after = used_bytes(cloning_fs)
    assert (r.bytes_cloned, r.bytes_copied_by_kernel, r.bytes_streamed, r.header_padding) == (size, 0, 0, 0)
    assert after - before < 0.02 * size, (before, after, size)
    for p in shards:
        out = clone_dir / "out" / p.name
        assert out.read_bytes() == p.read_bytes()  # same names, same bytes: the source's layout
        assert shared_bytes(out) >= p.stat().st_size - 4096
    # the plain path (no cloning on the test's own filesystem) writes the very same files
    plain = export(shutil.copytree(src, tmp_path / "src"), str(tmp_path / "plain"), opts("keep"))
    assert (plain.bytes_cloned, plain.bytes_copied_by_kernel, plain.bytes_streamed) == (0, r.total_size, 0)
    for p in sorted((clone_dir / "out").iterdir()):
        assert p.read_bytes() == (tmp_path / "plain" / p.name).read_bytes(), p.name


def test_reshard_clones_the_largest_run_of_every_shard(clone_dir: Path, tmp_path: Path) -> None:
    src = clone_dir / "src"
    tensors = big_state()
    write_sharded(src, tensors, max_shard_size="2MB")
    r = export(str(src), str(clone_dir / "out"), opts("3MB"))
    plain = export(shutil.copytree(src, tmp_path / "src"), str(tmp_path / "plain"), opts("3MB"))
    assert (plain.bytes_cloned, plain.header_padding, plain.bytes_copied_by_kernel) == (0, 0, plain.total_size)
    assert r.bytes_cloned + r.bytes_copied_by_kernel == r.total_size and r.bytes_streamed == 0
    assert [f["name"] for f in r.files] == [f["name"] for f in plain.files]
    locate = source_locator(src)
    min_cloned = 0
    for f in r.files:
        out, ref = clone_dir / "out" / f["name"], tmp_path / "plain" / f["name"]
        h, text, data = parsed(out)
        h_ref, text_ref, data_ref = parsed(ref)
        # same tensors at the same data offsets; the header only gains trailing spaces
        assert h == h_ref and data == data_ref
        assert text.rstrip(b" ") == text_ref.rstrip(b" ") and len(text) % 8 == 0
        hdr = read_header(out)
        assert not hdr.findings
        parts = [p for p in runs(sorted(hdr.tensors.values(), key=lambda i: i.begin), locate) if isinstance(p, Run)]
        best = max(parts, key=lambda p: p.nbytes)
        data_start = 8 + len(text)
        assert (data_start + best.begin - best.src_offset) % 4096 == 0  # placed congruent
        min_cloned += best.nbytes - 2 * 4096
        assert shared_bytes(out) >= best.nbytes - 2 * 4096
    assert r.bytes_cloned >= min_cloned > 0
    # every loader reads the padded headers and sees the same tensors
    for load in (load_glob, load_hub, load_single_first):
        assert same(load(clone_dir / "out"), tensors)


def source_locator(src: Path):
    where = {}
    for p in src.glob("*.safetensors"):
        h = read_header(p)
        for info in h.tensors.values():
            where[info.name] = (str(p), h.data_start + info.begin)
    return where.get


def test_padded_shards_load_in_transformers(clone_dir: Path) -> None:
    model = tiny_llama(seed=5)
    src = clone_dir / "src"
    model.save_pretrained(src)
    r = export(str(src), str(clone_dir / "out"), opts("40KB"))
    assert len(r.files) > 2 and r.header_padding > 0 and r.bytes_cloned > 0
    loaded = load_with_transformers(clone_dir / "out", type(model))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_pickle_sources_clone_from_the_archive(clone_dir: Path, tmp_path: Path) -> None:
    """A torch.save archive's records are byte ranges like a safetensors file's (issue 16): cloned
    where the filesystem can, copied by the kernel elsewhere, never streamed; the converted
    path streams and gives the same bytes as without clones."""
    tensors = big_state()
    write_pickle(clone_dir / "pk", tensors)
    write_pickle(tmp_path / "pk", tensors)
    r = export(str(clone_dir / "pk"), str(clone_dir / "out"), opts("3MB"))
    plain = export(str(tmp_path / "pk"), str(tmp_path / "out"), opts("3MB"))
    assert r.bytes_cloned > 0 and r.header_padding > 0 and r.bytes_streamed == plain.bytes_streamed == 0
    assert r.bytes_cloned + r.bytes_copied_by_kernel == plain.bytes_copied_by_kernel == r.total_size
    assert same(load_glob(clone_dir / "out"), tensors) and same(load_glob(tmp_path / "out"), tensors)
    c = export(str(clone_dir / "pk"), str(clone_dir / "fp16"), opts("3MB", dtype="fp16"))
    c_plain = export(str(tmp_path / "pk"), str(tmp_path / "fp16"), opts("3MB", dtype="fp16"))
    assert (c.bytes_cloned, c.header_padding) == (0, 0) and c.bytes_streamed == c_plain.bytes_streamed > 0
    for f in c.files:
        assert (clone_dir / "fp16" / f["name"]).read_bytes() == (tmp_path / "fp16" / f["name"]).read_bytes()


def test_unchanged_files_copied_instead_of_linked(clone_dir: Path, tmp_path: Path) -> None:
    for where, expect in ((clone_dir, "cloned"), (tmp_path, "copied")):
        src = write_single(where / "a", state(1, n=4, rows=256, cols=256))
        assert link_or_copy(src, where / "b.safetensors", link=False) == expect
        assert link_or_copy(src, where / "c.safetensors") == "linked"
        dst = where / "b.safetensors"
        assert dst.read_bytes() == src.read_bytes()
        assert os.stat(dst).st_nlink == 1 and os.stat(src).st_nlink == 2
        assert dst.stat().st_mode == src.stat().st_mode
        if expect == "cloned":
            assert shared_bytes(dst) >= src.stat().st_size - 4096


def test_cli_reports_cloned_copied_streamed(clone_dir: Path, run_cli) -> None:
    write_sharded(clone_dir / "src", big_state(), max_shard_size="2MB")
    rc, out, err = run_cli("export", clone_dir / "src", clone_dir / "out", "--max-shard-size", "keep", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["bytes_cloned"] == sum(f["size"] for f in doc["files"]) > 0
    assert doc["bytes_copied_by_kernel"] == doc["bytes_streamed"] == 0
    rc, out, err = run_cli("export", clone_dir / "src", clone_dir / "out2", "--max-shard-size", "3MB")
    assert rc == 0, err
    line = next(x for x in out.splitlines() + err.splitlines() if "copied by the kernel" in x)
    assert " cloned (shared with the source), " in line and " 0 bytes" not in f" {line}"  # only what happened


# --- the plain path and the pieces, on the test's own filesystem --------------------------------

def test_plain_filesystem_keeps_save_file_headers(tmp_path: Path) -> None:
    tensors = big_state()
    write_sharded(tmp_path / "src", tensors, max_shard_size="2MB")
    r = export(str(tmp_path / "src"), str(tmp_path / "out"), opts("3MB"))
    assert (r.bytes_cloned, r.header_padding, r.bytes_streamed) == (0, 0, 0)
    assert r.bytes_copied_by_kernel == r.total_size
    from safetensors.torch import save_file

    index = json.loads((tmp_path / "out" / INDEX).read_text())["weight_map"]
    for f in r.files:
        names = [k for k, v in index.items() if v == f["name"]]
        save_file({k: tensors[k] for k in names}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert (tmp_path / "out" / f["name"]).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_keep_layout_needs_files(tmp_path: Path, cli) -> None:
    # a pickle's tensors are stored in its file (issue 16): keep writes one safetensors file for it
    write_pickle(tmp_path / "pk", state(1))
    res = cli("export", tmp_path / "pk", tmp_path / "out", "--max-shard-size", "keep")
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert same(load_glob(tmp_path / "out"), state(1))
    from ckptctl.api import save_state_dict
    from ckptctl.errors import UsageError

    with pytest.raises(UsageError, match="keep needs a source stored in files"):
        save_state_dict(state(1), tmp_path / "sd", max_shard_size="keep")


def test_extra_padding_is_spaces_the_parsers_accept(tmp_path: Path) -> None:
    from safetensors import safe_open

    from ckptctl.format.tensor import TensorSpec

    specs = [TensorSpec("a", "F32", (3, 5)), TensorSpec("b", "BF16", (7,))]
    plain, layout = encode_header(specs, {"format": "pt"})
    padded, layout2 = encode_header(specs, {"format": "pt"}, extra_pad=4000)
    assert layout == layout2 and len(padded) == len(plain) + 4000
    assert padded[8:].rstrip(b" ") == plain[8:].rstrip(b" ")
    with pytest.raises(ValueError):
        encode_header(specs, None, extra_pad=4)
    p = tmp_path / "x.safetensors"
    p.write_bytes(padded + bytes(range(60)) + bytes(range(14)))
    with safe_open(str(p), "pt") as f:
        assert f.get_tensor("b").view(torch.uint8).tolist() == list(range(14))
    assert not read_header(p).findings
