"""DCP export by the kernel: chunks that are contiguous runs of their tensor (whole tensors,
dim-0 shards) are copied from the ``.distcp`` files at their offsets; the output is byte for byte
the streaming path's (``dcp.load`` per tensor), for 1-process and 2-process (Gloo) saves, and
transformers loads it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ckptctl.api import export
from ckptctl.sources.dcp.chunks import run_start
from ckptctl.write.inputs import open_inputs
from ckptctl.write.job import write_inputs
from ckptctl.write.options import ExportOptions
from tests.support import load_glob, run_ckptctl, same
from tests.support.builders import tiny_llama
from tests.support.loaders import load_with_transformers
from tests.test_distributed import _launch


def _streamed(src: Path, dst: Path, key: str | None = None, **opts) -> object:
    """The export of ``src`` with every tensor on the streaming path (no pieces)."""
    with open_inputs(src, dst, ExportOptions(**opts), key=key) as inputs:
        for e in inputs.entries:
            e.tensor.pieces = ()
            e.tensor.file = e.tensor.offset = None
        return write_inputs(inputs, dst)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(48, 40, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(33, 8, generator=g),  # rows do not split evenly over 2 ranks
        "c.bias": torch.randn(17, generator=g).half(),
        "d.index": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "e.mask": torch.rand(5, 6, generator=g) > 0.5,
        "f.scalar": torch.tensor(3.5, dtype=torch.float64),
        "g.empty": torch.zeros(0, 4),
        "h.cube": torch.randn(4, 3, 5, generator=g),
    }


def test_run_start_says_which_blocks_are_contiguous_runs():
    assert run_start((0, 0), (4, 8), (4, 8)) == 0  # the whole tensor
    assert run_start((2, 0), (2, 8), (4, 8)) == 16  # rows 2..4
    assert run_start((1, 2, 0), (1, 1, 5), (4, 3, 5)) == 25  # one row of one plane
    assert run_start((0, 4), (4, 4), (4, 8)) is None  # a column block is strided
    assert run_start((0, 1, 0), (2, 1, 5), (4, 3, 5)) is None
    assert run_start((3, 0), (2, 8), (4, 8)) is None  # outside the tensor
    assert run_start((), (), ()) == 0


def test_one_process_dcp_is_copied_by_the_kernel_byte_for_byte(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = _state()
    sd["i.transposed"] = torch.randn(6, 10).t()  # saved as a strided view: it streams
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=src, no_dist=True)
    fast = export(src, tmp_path / "fast", ExportOptions(max_shard_size="1KB"), key="model")
    slow = _streamed(src, tmp_path / "slow", key="model", max_shard_size="1KB")
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")
    assert len(_files(tmp_path / "fast")) > 3
    transposed = sd["i.transposed"].numel() * 4
    assert fast.bytes_streamed == transposed, (fast.bytes_streamed, transposed)
    assert fast.bytes_copied_by_kernel + fast.bytes_cloned == sum(t.numel() * t.element_size() for t in sd.values()) - transposed
    assert slow.bytes_copied_by_kernel == slow.bytes_cloned == 0
    got = load_glob(tmp_path / "fast")
    assert same(got, {k: v.contiguous() for k, v in sd.items()})


def test_converted_dcp_streams_and_equals_the_streaming_path(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    sd = {k: v for k, v in _state().items() if v.is_floating_point()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=src, no_dist=True)
    fast = export(src, tmp_path / "fast", ExportOptions(dtype="fp16"))
    _streamed(src, tmp_path / "slow", dtype="fp16")
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")
    same_dtype = sd["c.bias"].numel() * 2  # already fp16: copied; the others are converted
    assert fast.bytes_copied_by_kernel + fast.bytes_cloned == same_dtype
    assert fast.bytes_streamed == sum(v.numel() * 2 for v in sd.values()) - same_dtype


def _save_script(body: str) -> str:
    """A rank's script: Gloo up, a 1-D CPU mesh as ``mesh``, ``body`` saves, os._exit (as
    tests/test_dcp_source.py explains)."""
    return ("import os, sys\n"
            "import torch, torch.distributed as dist\n"
            "import torch.distributed.checkpoint as dcp\n"
            "from torch.distributed.device_mesh import init_device_mesh\n"
            "from torch.distributed.tensor import Shard, distribute_tensor\n"
            "dist.init_process_group('gloo')\n"
            "mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
            f"{body}"
            "dist.destroy_process_group()\n"
            "os._exit(0)\n")


_SAVE = _save_script(
    "from tests.test_dcp_zero_copy import _state\n"
    "sd = _state()\n"
    "out = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in sd.items() if v.dim() >= 2 and v.numel()}\n"
    "out['h.cube'] = distribute_tensor(sd['h.cube'], mesh, [Shard(1)])\n"  # strided chunks: streamed
    "out.update({k: v for k, v in sd.items() if k not in out})\n"
    "dcp.save({'model': out}, checkpoint_id=sys.argv[1])\n")


def _save_two_ranks(script: str, src: Path) -> None:
    outs = _launch(2, ["-c", script, str(src)])
    assert all(rc == 0 for rc, _, _ in outs), outs
    assert len(list(src.glob("*.distcp"))) == 2


def test_two_process_dcp_row_shards_are_copied_byte_for_byte(tmp_path):
    src = tmp_path / "dcp"
    _save_two_ranks(_SAVE, src)
    p = run_ckptctl("export", str(src), str(tmp_path / "fast"), "--key", "model", "--max-shard-size", "3KB")
    assert p.returncode == 0, p.stderr
    slow = _streamed(src, tmp_path / "slow", key="model", max_shard_size="3KB")
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")
    fast = export(src, tmp_path / "again", ExportOptions(max_shard_size="3KB"), key="model")
    sd = _state()
    assert fast.bytes_streamed == sd["h.cube"].numel() * 4, fast
    assert same(load_glob(tmp_path / "fast"), sd) and slow.bytes_streamed == sum(
        t.numel() * t.element_size() for t in sd.values())


_SAVE_MODEL = _save_script(
    "from tests.support.builders import tiny_llama\n"
    "sd = tiny_llama(seed=3).state_dict()\n"
    "dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in sd.items()}, checkpoint_id=sys.argv[1])\n")


def test_row_sharded_dcp_model_loads_in_transformers(tmp_path):
    src = tmp_path / "dcp"
    _save_two_ranks(_SAVE_MODEL, src)
    model = tiny_llama(seed=3)
    model.config.save_pretrained(src)
    res = export(src, tmp_path / "out", ExportOptions(max_shard_size="40KB"))
    assert res.bytes_streamed == 0 and res.bytes_copied_by_kernel + res.bytes_cloned > 0
    loaded = load_with_transformers(tmp_path / "out")
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("damage", ["pickle", "record"])
def test_a_chunk_archive_that_does_not_say_what_the_metadata_says_streams(tmp_path, damage):
    """A chunk whose data.pkl refers to another global, or whose storage record is not where the
    zip says, is not copied: torch's own reader decides (here it refuses)."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    sd = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}
    dcp.save(sd, checkpoint_id=src, no_dist=True)
    f = next(src.glob("*.distcp"))
    raw = bytearray(f.read_bytes())
    if damage == "pickle":
        at = raw.index(b"_rebuild_tensor_v2")
        raw[at:at + 18] = b"_rebuild_tensor_v9"
    else:
        at = raw.index(b"archive/data/0") - 30  # the record's local header
        assert raw[at:at + 4] == b"PK\x03\x04"
        raw[at:at + 4] = b"XX\x03\x04"
    f.write_bytes(bytes(raw))
    from ckptctl.sources.dcp.source import DcpSource

    with DcpSource.open(src) as s:
        assert [t.pieces for t in s.tensors] == [()]
    p = run_ckptctl("export", str(src), str(tmp_path / "out"))
    assert p.returncode != 0 and not (tmp_path / "out").exists(), p.stderr
