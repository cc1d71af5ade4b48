"""The writer's parts on real files: what an old version loses and keeps, shard allocation and
placement, the one duplicate-name check of each layer, plan names."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptctl.api import CheckpointWriter
from ckptctl.errors import InputError
from ckptctl.format.tensor import TensorSpec
from ckptctl.manifest import MANIFEST_NAME
from ckptctl.plan import make_plan
from ckptctl.sources.safetensors_source import SafetensorsSource
from ckptctl.sources.torch_source import TorchSource
from ckptctl.write.inputs import entries_for
from ckptctl.write.job import write_checkpoint
from ckptctl.write.options import ExportOptions
from ckptctl.write.shards import TensorWriter, create_shard, write_into
from ckptctl.write.superseded import superseded
from tests.support import state, write_sharded


# --- superseded ----------------------------------------------------------------------------------

def _old_version(d: Path) -> None:
    write_sharded(d, state(1, n=4), per_shard=2)
    torch.save(state(2, n=1), d / "pytorch_model.bin")
    torch.save(state(3, n=1), d / "pytorch_model.fp16.bin")
    save_file({"x": torch.ones(2)}, str(d / "consolidated.safetensors"))
    save_file({"lora": torch.ones(2)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (d / "model-00001-of-?????.safetensors").write_bytes(b"temp shard of a streaming saver")
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "README.md").write_text("notes")
    (d / "optimizer").mkdir()
    (d / "optimizer" / "state.pt").write_bytes(b"opt")
    (d / MANIFEST_NAME).write_text("{}")
    (d / ".metadata").write_bytes(b"dcp")
    (d / "__0_0.distcp").write_bytes(b"dcp")


def test_superseded_model_drops_every_model_weights_file_and_keeps_the_rest(tmp_path):
    _old_version(tmp_path)
    drop, keep = superseded(tmp_path)
    assert drop == sorted([".metadata", "__0_0.distcp", MANIFEST_NAME,
                           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model-00001-of-?????.safetensors", "model.safetensors.index.json",
                           "pytorch_model.bin"])
    # the fp16 variant is another slot: the new main model does not own it; a safetensors file
    # outside the naming scheme is not provably a superseded family (issue 15): carried
    assert keep == ["README.md", "adapter_config.json", "adapter_model.safetensors", "config.json",
                    "consolidated.safetensors", "optimizer", "pytorch_model.fp16.bin"]


def test_superseded_adapter_drops_only_the_adapter_weights(tmp_path):
    _old_version(tmp_path)
    drop, keep = superseded(tmp_path, slot=("adapter_model", None))
    assert drop == sorted([MANIFEST_NAME, "adapter_model.safetensors", "model-00001-of-?????.safetensors"])
    assert set(keep) == set(os.listdir(tmp_path)) - set(drop)


def test_superseded_of_a_missing_destination_is_empty(tmp_path):
    assert superseded(tmp_path / "nothing") == ([], [])


def test_superseded_variant_drops_only_its_own_family(tmp_path):
    _old_version(tmp_path)
    for n in ("model.fp16-00001-of-00002.safetensors", "model.fp16-00002-of-00002.safetensors"):
        save_file({n: torch.ones(1)}, str(tmp_path / n))
    (tmp_path / "model.safetensors.index.fp16.json").write_text('{"metadata": {}, "weight_map": {}}')
    drop, keep = superseded(tmp_path, slot=("model", "fp16"))
    assert drop == sorted([MANIFEST_NAME, "model-00001-of-?????.safetensors", "model.fp16-00001-of-00002.safetensors",
                           "model.fp16-00002-of-00002.safetensors", "model.safetensors.index.fp16.json",
                           "pytorch_model.fp16.bin"])
    assert set(keep) == set(os.listdir(tmp_path)) - set(drop)


def test_superseded_diffusers_component_keeps_transformers_files(tmp_path):
    save_file({"a": torch.ones(1)}, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    save_file({"a": torch.ones(1)}, str(tmp_path / "diffusion_pytorch_model.fp16.safetensors"))
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    (tmp_path / "config.json").write_text("{}")
    drop, keep = superseded(tmp_path, slot=("diffusion_pytorch_model", None))
    assert drop == ["diffusion_pytorch_model.bin", "diffusion_pytorch_model.safetensors"]
    assert keep == ["config.json", "diffusion_pytorch_model.fp16.safetensors"]


# --- shards ----------------------------------------------------------------------------------------

def _source(tmp_path: Path) -> tuple[Path, SafetensorsSource]:
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, 4, dtype=torch.bfloat16),
               "c": torch.arange(5, dtype=torch.int64)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, SafetensorsSource.open(tmp_path, [path.name])


def test_create_shard_allocates_header_and_data_area_and_never_overwrites(tmp_path):
    path, src = _source(tmp_path)
    [shard] = make_plan([t.spec for t in src.tensors], max_shard_size=10**9).shards
    out = tmp_path / "new.safetensors"
    os.close(create_shard(out, shard))
    raw = out.read_bytes()
    assert len(raw) == shard.file_size == path.stat().st_size
    assert raw[:shard.data_start] == shard.header == path.read_bytes()[:shard.data_start]
    assert raw[shard.data_start:] == bytes(shard.data_bytes)
    with pytest.raises(FileExistsError):
        create_shard(out, shard)


def _mib_shard(tmp_path: Path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    save_file({"w": torch.ones(256, 1024)}, str(src_dir / "model.safetensors"))
    [shard] = make_plan([t.spec for t in SafetensorsSource.open(src_dir, ["model.safetensors"]).tensors],
                        max_shard_size=10**9).shards
    return shard


def test_create_shard_reserves_the_data_areas_blocks_unless_told_not_to(tmp_path):
    """Blocks reserved up front (a full disk fails before any copy; ext4 writes copied tensors
    with less cpu); a shard whose blocks a clone will share is sized by ftruncate, sparse."""
    from ckptctl import _libc

    shard = _mib_shard(tmp_path)
    fstype = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fstype not in ("ext2/ext3", "xfs", "btrfs", "tmpfs"):  # these allocate: the binding must work there
        pytest.skip(f"{tmp_path} is {fstype or 'of an unknown type'}: it may not allocate")
    with open(tmp_path / "probe", "wb") as f:
        _libc.fallocate(f.fileno(), 0, 4096)
    os.close(create_shard(tmp_path / "reserved", shard))
    os.close(create_shard(tmp_path / "sparse", shard, allocate=False))
    reserved, sparse = os.stat(tmp_path / "reserved"), os.stat(tmp_path / "sparse")
    assert reserved.st_size == sparse.st_size == shard.file_size
    assert reserved.st_blocks * 512 >= shard.data_bytes > sparse.st_blocks * 512
    for name in ("reserved", "sparse"):
        raw = (tmp_path / name).read_bytes()
        assert raw[:shard.data_start] == shard.header and raw[shard.data_start:] == bytes(shard.data_bytes)


def test_create_shard_where_the_filesystem_cannot_allocate_sizes_the_file_by_ftruncate(tmp_path):
    """A FUSE filesystem without a fallocate operation (as NFSv3): EOPNOTSUPP, never zeros
    written by hand (``posix_fallocate``'s fallback), the same file."""
    from ckptctl import _libc
    from tests.fusefs import MountRefused, mounted

    shard = _mib_shard(tmp_path)
    try:
        with mounted(tmp_path / "fuse", refuse_rename_flags=False, silly="none") as m:
            with open(m.mnt / "probe", "wb") as f, pytest.raises(OSError) as refused:
                _libc.fallocate(f.fileno(), 0, 4096)
            assert refused.value.errno in (errno.EOPNOTSUPP, errno.ENOSYS)
            os.close(create_shard(m.mnt / "shard", shard))
            raw = (m.mnt / "shard").read_bytes()
    except MountRefused as exc:
        pytest.skip(str(exc))
    assert len(raw) == shard.file_size
    assert raw[:shard.data_start] == shard.header and raw[shard.data_start:] == bytes(shard.data_bytes)


def test_tensors_placed_by_two_writers_give_the_reference_file(tmp_path):
    path, src = _source(tmp_path)
    entries = {e.name: e for e in entries_for(src, None)}
    [shard] = make_plan([e.spec for e in entries.values()], max_shard_size=10**9).shards
    out = tmp_path / "new.safetensors"
    fd = create_shard(out, shard)
    os.close(fd)
    counts = []
    for only in ({"b"}, {"a", "c"}):  # as two ranks would, each through its own descriptor
        tw = TensorWriter(chunk_bytes=8)
        fd = os.open(out, os.O_WRONLY)
        try:
            counts.append(write_into(fd, shard, entries, tw, only=only))
        finally:
            os.close(fd)
            tw.close()
        assert tw.copied == counts[-1] and tw.streamed == 0  # unchanged dtype: the kernel copies
    assert sum(counts) == shard.data_bytes and counts[0] == 24
    assert out.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("dtype", [None, "fp16"])
def test_writeback_in_steps_gives_the_same_file_as_one_copy(tmp_path, monkeypatch, dtype):
    """With fsync ahead, kernel copies go in steps, each one's writeback started: runs longer
    than a step, a step boundary inside a tensor, and streamed (converted) chunks land where one
    copy would have put them."""
    from ckptctl.write import shards as shards_mod

    monkeypatch.setattr(shards_mod, "WRITEBACK_STEP", 4096 * 3)
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    save_file({"a": torch.randn(7, 1000), "b": torch.randn(3, 333), "c": torch.randn(10_000)},
              str(src_dir / "model.safetensors"))
    src = SafetensorsSource.open(src_dir, ["model.safetensors"])
    entries = {e.name: e for e in entries_for(src, dtype)}
    [shard] = make_plan([e.spec for e in entries.values()], max_shard_size=10**9).shards
    from ckptctl import _libc

    real, hints = _libc.sync_file_range, []

    def spy(fd: int, offset: int, length: int) -> None:  # the real call, recorded
        hints.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(_libc, "sync_file_range", spy)
    files = {}
    for writeback in (False, True):
        hints.clear()
        out = tmp_path / f"writeback-{writeback}.safetensors"
        tw = TensorWriter(chunk_bytes=5000, writeback=writeback)
        fd = create_shard(out, shard)
        try:
            write_into(fd, shard, entries, tw)
            os.fsync(fd)
        finally:
            os.close(fd)
            tw.close()
        assert tw.writeback == writeback  # the filesystem took every hint
        if not writeback:
            assert hints == []
        else:  # back to back from the data section on, each at least a step, each ending on a page
            step = shards_mod.WRITEBACK_STEP
            assert hints and hints[0][0] == shard.data_start
            assert all(a + n == b for (a, n), (b, _) in zip(hints, hints[1:]))
            assert all(n >= step and (a + n) % 4096 == 0 for a, n in hints)
            assert shard.file_size - (hints[-1][0] + hints[-1][1]) < step + 4096
        assert (tw.copied, tw.streamed) == ((shard.data_bytes, 0) if dtype is None else (0, shard.data_bytes))
        files[writeback] = out.read_bytes()
    assert files[True] == files[False]
    if dtype is None:
        assert files[True][shard.data_start:] == (src_dir / "model.safetensors").read_bytes()[-shard.data_bytes:]


def test_converted_tensors_stream_in_chunks(tmp_path):
    _, src = _source(tmp_path)
    entries = {e.name: e for e in entries_for(src, "fp16")}
    assert {n: e.dtype for n, e in entries.items()} == {"a": "F16", "b": "F16", "c": "I64"}  # only floats convert
    [shard] = make_plan([e.spec for e in entries.values()], max_shard_size=10**9).shards
    out = tmp_path / "half.safetensors"
    tw = TensorWriter(chunk_bytes=8)
    fd = create_shard(out, shard)
    try:
        assert write_into(fd, shard, entries, tw) == shard.data_bytes
    finally:
        os.close(fd)
        tw.close()
    assert tw.streamed == 12 + 24 and tw.copied == 40  # a and b converted; c copied as it is
    from safetensors.torch import load_file
    got = load_file(str(out))
    assert torch.equal(got["a"], torch.arange(6, dtype=torch.float16)) and got["b"].dtype == torch.float16


# --- one duplicate check per layer ------------------------------------------------------------------

def test_a_tensor_in_two_safetensors_files_is_refused_naming_both(tmp_path):
    save_file({"w": torch.ones(2), "x": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(InputError, match="'w' is stored in both a.safetensors and b.safetensors"):
        SafetensorsSource.open(tmp_path, ["a.safetensors", "b.safetensors"])


def test_a_tensor_in_two_pickle_shards_is_refused_naming_both(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    with pytest.raises(InputError, match="'w' is stored in both pytorch_model-00001-of-00002.bin and "
                                         "pytorch_model-00002-of-00002.bin"):
        TorchSource.open(tmp_path, ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"])


def test_entries_given_twice_are_refused_before_any_io(tmp_path):
    _, src = _source(tmp_path)
    entries = entries_for(src, None)
    again = entries_for(src, None)[0]  # another record of the same tensor
    with pytest.raises(InputError, match=f"'{again.name}' is given twice"):
        write_checkpoint(entries + [again], tmp_path / "out", ExportOptions())
    with pytest.raises(InputError, match=f"'{again.name}' is given twice"):
        write_checkpoint(entries + entries[:1], tmp_path / "out", ExportOptions())
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_checkpoint_writer_refuses_a_name_added_twice(tmp_path):
    path, src = _source(tmp_path)
    w = CheckpointWriter(tmp_path / "out")
    w.add("a", torch.ones(2))
    with pytest.raises(InputError, match="added twice"):
        w.add_range("a", "F32", (6,), path, src.tensors[0].offset)
    with pytest.raises(InputError, match="added twice"):
        w.add("a", torch.zeros(2))


# --- plan names --------------------------------------------------------------------------------------

def test_plan_names_single_sharded_and_adapter():
    specs = [TensorSpec(f"t{i}", "U8", (10,)) for i in range(5)]
    one = make_plan(specs, max_shard_size=100)
    assert [s.name for s in one.shards] == ["model.safetensors"] and one.index_name is None
    many = make_plan(specs, max_shard_size=25)
    assert [s.name for s in many.shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [[x.name for x in s.specs] for s in many.shards] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert many.index_name == "model.safetensors.index.json"
    assert many.files == [s.name for s in many.shards] + ["model.safetensors.index.json"]
    ad = make_plan(specs, max_shard_size=25, prefix="adapter_model", single_file=True)
    assert [s.name for s in ad.shards] == ["adapter_model.safetensors"] and ad.index_name is None
