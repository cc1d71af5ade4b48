"""Issue 44, the two torch-archive cases still open from issue 33:

- A storage re-typed by a later tensor's persistent id (``torch.save`` never writes it; a crafted
  or damaged file): ``torch.load`` builds the later tensor over the first typed storage. Where
  that view equalled an earlier tensor's, the export took it for a tie and dropped the later
  name: ``torch.load`` gave ``{"a", "b"}``, the export ``{"a"}``. Now the export is what
  ``torch.load`` gives, name for name and bit for bit, or a refusal where torch refuses.
- A ``byteorder`` record outside the archive's directory (torch's reader takes the directory of
  the first record) was read: ``other/byteorder`` saying ``big`` refused a sound file. Now only
  the archive's own is read, by the ZeRO and Megatron readers too (which read none before).
"""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from tests.support.cli import run_ckptctl
from tests.support.loaders import load_glob
from tests.test_zero_build import NEEDS_DEEPSPEED, step, zero_ckpts  # noqa: F401 - the fixture


def _rewrite(path: Path, change=lambda name, data: data, extra: dict[str, bytes] | None = None,
             first: dict[str, bytes] | None = None) -> None:
    """Rewrite the zip archive ``path``: each member through ``change``, ``first`` records before
    them, ``extra`` after (all stored)."""
    src = zipfile.ZipFile(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in (first or {}).items():
            z.writestr(name, data)
        for info in src.infolist():
            z.writestr(info.filename, change(info.filename, src.read(info)))
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    src.close()
    path.write_bytes(buf.getvalue())


def _key(k: bytes) -> bytes:
    return b"X" + len(k).to_bytes(4, "little") + k  # BINUNICODE, as torch.save writes a storage key


def _same_as_torch(src: Path, out: Path) -> None:
    expect = torch.load(src / "pytorch_model.bin", weights_only=True, mmap=True)
    r = run_ckptctl("export", src, out, "--no-fsync")
    assert r.returncode == 0, r.stderr
    got = load_glob(out)
    assert sorted(got) == sorted(expect)
    for k, v in expect.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


B = {"half": torch.arange(8, dtype=torch.float16), "uint8": torch.arange(8, dtype=torch.uint8),
     "bool": torch.ones(8, dtype=torch.bool), "int64": torch.arange(4, dtype=torch.int64),
     "int16 2x2": torch.arange(4, dtype=torch.int16).reshape(2, 2)}


@pytest.mark.parametrize("b", sorted(B))
def test_a_storage_re_typed_by_a_later_tensor_exports_what_torch_loads(tmp_path, b):
    """``b``'s persistent id names storage ``0`` (``a``'s, float32) with its own type: torch.load
    gives ``b`` as float32 over ``a``'s bytes; with 8 elements that view is ``a``'s own."""
    src = tmp_path / "src"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(8, dtype=torch.float32) + 0.5, "b": B[b]}, p)
    _rewrite(p, lambda name, data: data.replace(_key(b"1"), _key(b"0")) if name.endswith("/data.pkl") else data)
    _same_as_torch(src, tmp_path / "out")


def test_a_re_typed_storage_torch_cannot_build_is_refused(tmp_path):
    """``a`` (int32, 4 elements) first, then ``b`` (8 floats) over the same key: torch.load
    refuses ("Trying to resize storage"), and so does the export."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(4, dtype=torch.int32), "b": torch.arange(8, dtype=torch.float32)}, p)
    _rewrite(p, lambda name, data: data.replace(_key(b"1"), _key(b"0")) if name.endswith("/data.pkl") else data)
    with pytest.raises(RuntimeError):
        torch.load(p, weights_only=True, mmap=True)
    r = run_ckptctl("export", src, out, "--no-fsync")
    assert r.returncode == 2 and "reaches past the end" in r.stderr, r.stderr
    assert not out.exists()


def test_tied_weights_torch_saved_stay_tied(tmp_path):
    """The same tensor under two names (no re-typing): one copy and an alias, as before."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save({"model.embed_tokens.weight": w, "lm_head.weight": w}, src / "pytorch_model.bin")
    r = run_ckptctl("export", src, out, "--no-fsync")
    assert r.returncode == 0, r.stderr
    assert sorted(load_glob(out)) == ["model.embed_tokens.weight"]


def test_a_byteorder_record_below_the_archive_is_not_read(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(6, dtype=torch.float32)}, p)
    prefix = zipfile.ZipFile(p).namelist()[0].split("/")[0]
    _rewrite(p, extra={f"{prefix}/data/byteorder": b"big", f"{prefix}/sub/byteorder": b"big"})
    _same_as_torch(src, tmp_path / "out")


@pytest.mark.parametrize("where", ["last", "first"])
def test_a_record_outside_the_archive_directory_is_refused_as_torch_refuses_it(tmp_path, where):
    """``other/byteorder`` saying ``big``: before, the export read it (and refused the file for
    its byte order, or, first in the archive, read ``archive/data.pkl`` torch never finds)."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(6, dtype=torch.float32)}, p)
    _rewrite(p, **{"extra" if where == "last" else "first": {"other/byteorder": b"big"}})
    with pytest.raises(RuntimeError):  # "not in a subdirectory"; first: no other/version record
        torch.load(p, weights_only=True, mmap=True)
    r = run_ckptctl("export", src, out, "--no-fsync")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2 and lines[0].startswith("error:"), r.stderr
    assert "is outside the archive's directory" in lines[0] and "byte order" not in lines[0], lines
    assert not out.exists()


@NEEDS_DEEPSPEED
def test_a_big_endian_zero_rank_file_is_refused(zero_ckpts, tmp_path):
    """DeepSpeed loads its files with torch.load, which swaps a big-endian archive's bytes; the
    ZeRO reader read them as little-endian (it read no byteorder record)."""
    folder, out = tmp_path / "global_step3", tmp_path / "out"
    shutil.copytree(step(zero_ckpts["s2_bf16"]), folder)
    (f,) = folder.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _rewrite(f, lambda name, data: b"big" if name.endswith("/byteorder") else data)
    r = run_ckptctl("export", folder, out, "--no-fsync")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2 and "byte order is 'big'" in lines[0], r.stderr
    assert not out.exists()


def _deflate_data_pkl(p: Path) -> None:
    """Write the torch.save archive ``p`` again with its data.pkl deflated (the rest stored)."""
    with zipfile.ZipFile(p) as old:
        records = [(i.filename, old.read(i)) for i in old.infolist()]
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            z.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED if name.endswith("/data.pkl") else None)


def test_a_sound_archive_with_a_compressed_data_pkl_still_exports_what_torch_loads(tmp_path):
    """The records cannot map a deflated data.pkl: torch.load reads the file, after the walk
    (``tests/test_pickle_budget.py``: the walk refuses a hostile one first)."""
    src = tmp_path / "src"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}, p)
    _deflate_data_pkl(p)
    _same_as_torch(src, tmp_path / "out")


def test_a_damaged_compressed_data_pkl_is_one_input_error_in_every_command(tmp_path):
    """A deflated data.pkl whose compressed bytes are damaged: zlib's error is the file's, so every
    command says so in one line (exit 2), never a traceback; nothing is published."""
    import struct

    from tests.support.cli import invoke

    src = tmp_path / "src"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(600, dtype=torch.float32)}, p)
    _deflate_data_pkl(p)
    with zipfile.ZipFile(p) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    raw = bytearray(p.read_bytes())
    n, m = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + n + m
    raw[start:start + info.compress_size] = bytes([0xFF]) * info.compress_size  # not a deflate stream
    p.write_bytes(bytes(raw))
    for argv in (("inspect", src), ("verify", "--static", src), ("export", src, tmp_path / "out")):
        r = invoke(*argv)
        assert r.exit_code in (1, 2) and "Traceback" not in r.stderr and "zlib" not in type(r.exception).__module__, \
            (argv, r.exit_code, r.stderr)
    assert not (tmp_path / "out").exists()
