"""torch's DCP-HF sharded output (``HuggingFaceStorageWriter``, ``sharded/`` with
``DCP_SHARDING_INFO``) as an export source: saved for real by torch (one process, and two ranks
over Gloo), exported, and compared bit for bit with torch's own loading of the shards
(``dcp.load`` with ``HuggingFaceStorageReader``); damaged saves refused with nothing published."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.support import invoke, run_ckptctl, staging_dirs
from tests.support import load_glob as load_dir
from tests.test_distributed import _launch

# fqn -> (dtype, shape, sharded dimension or None for a replicated tensor)
LAYOUT = {
    "model.embed.weight": (torch.float32, (10, 6), 0),
    "model.norm.weight": (torch.bfloat16, (7, 4), 0),  # uneven: 4 + 3 rows
    "model.positions": (torch.int64, (9,), 0),
    "model.mask": (torch.bool, (5, 3), 0),
    "model.proj.weight": (torch.float32, (4, 10), 1),  # column shards: streamed
    "model.index_col": (torch.int64, (3, 5), 1),  # uneven column shards of an integer tensor
    "model.flags_col": (torch.bool, (3, 8), 1),
    "model.wide": (torch.float32, (2, 4, 131072), 1),  # column shards whose runs are 1 MiB: pieces
    "model.bias": (torch.float32, (3,), None),  # replicated: saved once
}
MAPPING = {k: 1 + i % 2 for i, k in enumerate(sorted(LAYOUT))}  # two files per rank


def full_state(floats_only: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for k, (dtype, shape, _) in LAYOUT.items():
        if dtype == torch.bool:
            t = torch.rand(shape, generator=g) > 0.5
        elif dtype == torch.int64:
            t = torch.randint(-2 ** 62, 2 ** 62, shape, generator=g)
        else:
            t = torch.randn(shape, generator=g).to(dtype)
        if t.is_floating_point() or not floats_only:
            out[k] = t
    return out


def save_sharded(mixed: str, floats: str) -> None:
    """On each rank (2, Gloo): the DTensor state saved with ``enable_consolidation`` twice: every
    dtype (torch's consolidation fails: its message is kept in ``mixed``.error), and floats only
    (it succeeds, leaving ``sharded/`` beside its output)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def state(floats_only: bool) -> dict:
        return {k: v if LAYOUT[k][2] is None else distribute_tensor(v, mesh, [Shard(LAYOUT[k][2])])
                for k, v in full_state(floats_only).items()}

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        dcp.save(state(False), storage_writer=HuggingFaceStorageWriter(
            mixed, save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=MAPPING))
    except CheckpointException as exc:  # torch's own consolidation failing is the point
        if dist.get_rank() == 0:
            Path(mixed + ".error").write_text(str(exc))
    dcp.save(state(True), storage_writer=HuggingFaceStorageWriter(floats, save_distributed=True,
                                                                   enable_consolidation=True))


_SAVE = ("import os, sys\n"
         "import torch.distributed as dist\n"
         "from tests.test_dcp_hf_source import save_sharded\n"
         "dist.init_process_group('gloo')\n"
         "save_sharded(sys.argv[1], sys.argv[2])\n"
         "dist.destroy_process_group()\n"
         "os._exit(0)\n")


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcphf")
    outs = _launch(2, ["-c", _SAVE, str(d / "mixed"), str(d / "floats")])
    assert all(rc == 0 for rc, _, _ in outs), outs
    return d


def torch_load(d: Path) -> dict[str, torch.Tensor]:
    """The oracle: torch's own reader of the shards, into full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = HuggingFaceStorageReader(str(d)).read_metadata()
        out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
        dcp.load(out, storage_reader=HuggingFaceStorageReader(str(d)), no_dist=True)
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def test_two_rank_save_exports_bit_exact_from_root_and_sharded_dir(tmp_path, saves):
    """Every dtype (float32, bf16, int64, bool), row and column shards, uneven splits, two files
    per rank: the root (torch's consolidation failed on the integer and bool tensors, leaving
    only ``sharded/``) and ``sharded/`` itself export to the tensors torch reads from them."""
    root = saves / "mixed"
    assert "finfo" in (saves / "mixed.error").read_text()  # torch 2.13: TypeError in its consolidation
    assert not list(root.glob("*.safetensors")) and len(list((root / "sharded").glob("shard-*"))) == 4
    oracle = torch_load(root / "sharded")
    assert same_bits(oracle, full_state())
    for src, dst in ((root, tmp_path / "a"), (root / "sharded", tmp_path / "b")):
        r = invoke("export", src, dst, "--max-shard-size", "1MB")
        assert r.exit_code == 0, r.stderr
        assert same_bits(load_dir(dst), oracle)
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(LAYOUT) and not (dst / "sharded").exists()


def test_streamed_reference_equals_pieces(saves):
    """The seam: a source with ``max_pieces=0`` streams every tensor through ``chunks`` (in
    windows of a few bytes here, so every window shape is taken); its bytes equal the pieces'
    tensors and torch's. Which tensors the kernel copies: row shards and 1 MiB column runs."""
    from ckptctl.sources.dcp.hf import DcpHfSource

    d = saves / "mixed" / "sharded"
    oracle = torch_load(d)
    with DcpHfSource.open(d) as fast, DcpHfSource.open(d, max_pieces=0) as ref:
        pieces = {t.name: len(t.pieces) for t in fast.tensors}
        assert pieces["model.embed.weight"] == 2 and pieces["model.wide"] == 4 and pieces["model.bias"] == 1
        assert pieces["model.proj.weight"] == pieces["model.flags_col"] == 0  # 20-byte runs: streamed
        assert not any(t.pieces for t in ref.tensors)
        by_name = {t.name: t for t in fast.tensors}
        for t in ref.tensors:
            want = oracle[t.name].reshape(-1).view(torch.uint8).numpy().tobytes()
            small = 24 if t.nbytes < 10_000 else 1 << 20
            assert b"".join(bytes(c) for c in ref.chunks(t, chunk_bytes=small)) == want, t.name
            got = bytearray(t.nbytes)
            for p in by_name[t.name].pieces:
                with open(p.file, "rb") as f:
                    f.seek(p.src_offset)
                    got[p.dst_offset:p.dst_offset + p.nbytes] = f.read(p.nbytes)
            assert not by_name[t.name].pieces or bytes(got) == want, t.name
        proj = next(t for t in ref.tensors if t.name == "model.proj.weight")
        as_bf16 = b"".join(bytes(c) for c in ref.chunks(proj, "BF16", chunk_bytes=16))
        assert as_bf16 == oracle["model.proj.weight"].to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_export_streamed_is_byte_identical_to_kernel_copied(tmp_path, saves):
    """The whole export with every tensor streamed (no pieces) writes the same bytes."""
    from ckptctl.write.inputs import open_inputs
    from ckptctl.write.job import write_inputs
    from ckptctl.write.options import ExportOptions

    src = saves / "mixed" / "sharded"
    with open_inputs(src, tmp_path / "streamed", ExportOptions()) as inputs:
        for e in inputs.entries:
            e.tensor.pieces = ()
        write_inputs(inputs, tmp_path / "streamed")
    r = invoke("export", src, tmp_path / "copied")
    assert r.exit_code == 0, r.stderr
    names = ("streamed", "copied")
    assert len({(tmp_path / n / "model.safetensors").read_bytes() for n in names}) == 1


def test_complete_consolidation_is_preferred_an_incomplete_one_is_not(tmp_path, saves):
    """A root with torch's complete consolidated files and ``sharded/`` reads the consolidated
    files (the same tensors); with a consolidated file cut short it reads ``sharded/``; with
    consolidated files that hold other tensors it refuses to choose."""
    from ckptctl.sources import open_source

    root = shutil.copytree(saves / "floats", tmp_path / "floats")
    oracle = torch_load(root / "sharded")
    assert same_bits(oracle, full_state(floats_only=True))
    with open_source(root) as src:
        assert src.kind == "safetensors"
    cons = root / "model-00001-of-00001.safetensors"
    cons.write_bytes(cons.read_bytes()[:-8])
    with open_source(root) as src:
        assert src.kind == "dcp-hf"
    r = invoke("export", root, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert same_bits(load_dir(tmp_path / "out"), oracle)
    from safetensors.torch import save_file

    (root / "model.safetensors.index.json").unlink()
    cons.unlink()
    save_file({"model.bias": torch.zeros(4)}, str(root / "model.safetensors"))
    r = invoke("export", root, tmp_path / "o2")
    assert r.exit_code == 2 and "disagree" in r.stderr and "--only safetensors" in r.stderr, r.stderr
    assert not (tmp_path / "o2").exists() and staging_dirs(tmp_path) == []


def test_single_process_save_and_the_consolidation_torch_cannot_do(tmp_path):
    """One process, no process group: torch's own consolidation raises on int64 and bool (the
    message names torch.finfo) and leaves ``sharded/`` alone; ckptctl exports it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = full_state()
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings(), pytest.raises(CheckpointException, match="finfo"):
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "ckpt"), save_distributed=True,
                                                                enable_consolidation=True))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["sharded"]
    r = invoke("export", tmp_path / "ckpt", tmp_path / "out", "--dtype", "bf16")
    assert r.exit_code == 0, r.stderr
    got, oracle = load_dir(tmp_path / "out"), torch_load(tmp_path / "ckpt" / "sharded")
    assert same_bits(oracle, state)
    assert same_bits(got, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()})


def test_inspect_shows_the_global_tensors(saves):
    r = invoke("inspect", saves / "mixed", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "dcp-hf" and doc["tensor_count"] == len(LAYOUT)
    shapes = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in doc["tensors"]}
    assert shapes["model.norm.weight"] == ("BF16", (7, 4)) and shapes["model.index_col"] == ("I64", (3, 5))
    assert all(f["name"].startswith("sharded/shard-") for f in doc["files"])


def _shard(path: Path, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]] | None, **info) -> None:
    from safetensors.torch import save_file

    meta = {"DCP_VERSION": "1.0"}
    if offsets is not None:
        meta["DCP_SHARDING_INFO"] = json.dumps({k: {"saved_offsets": o} for k, o in offsets.items()} | info)
    save_file(tensors, str(path), metadata=meta)


def _refused(tmp_path: Path, src: Path, *words: str) -> None:
    p = run_ckptctl("export", src, tmp_path / "out")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "hint:" in p.stderr, p.stderr
    assert all(w in p.stderr for w in words), p.stderr
    assert not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []


def test_damaged_saves_are_refused_and_nothing_is_published(tmp_path, saves):
    """A missing shard file (a hole in the tensors), a truncated one, a stray copy (overlap):
    exit 2, one line and a hint, no traceback, nothing published."""
    src = saves / "mixed" / "sharded"
    missing = shutil.copytree(src, tmp_path / "missing")
    (missing / "shard-00001-model-00001-of-00002.safetensors").unlink()
    _refused(tmp_path, missing, "a shard file is missing", "no shard-00001-model-00001-of-00002")
    trunc = shutil.copytree(src, tmp_path / "trunc")
    f = trunc / "shard-00002-model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _refused(tmp_path, trunc, "truncated")
    overlap = shutil.copytree(src, tmp_path / "overlap")
    shutil.copy(overlap / "shard-00002-model-00001-of-00002.safetensors",
                overlap / "shard-00003-model-00001-of-00002.safetensors")
    _refused(tmp_path, overlap, "overlap")
    _refused(tmp_path, src / "shard-00001-model-00001-of-00002.safetensors", "one rank's shard")
    # every rank's file of model 2 lost: its tensors are gone, and no tensor has a hole to show it
    gone = shutil.copytree(src, tmp_path / "gone")
    for f in gone.glob("shard-*-model-00002-of-00002.safetensors"):
        f.unlink()
    _refused(tmp_path, gone, "model files 2 of 2 are missing")


def test_inconsistent_shards_are_refused(tmp_path):
    """Shards written by hand: dtypes or ranks that differ between files, offsets that do not
    fit the shape, a file without sharding info beside the others, a tensor the info omits."""
    cases = {
        "dtype": ([{"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3, dtype=torch.float16)}],
                  [{"w": [0, 0]}, {"w": [2, 0]}], "the shards disagree"),
        "rank": ([{"w": torch.zeros(2, 3)}, {"w": torch.zeros(6)}], [{"w": [0, 0]}, {"w": [2]}], "disagree"),
        "offsets": ([{"w": torch.zeros(2, 3)}], [{"w": [0]}], "saved_offsets"),
        "no_info": ([{"w": torch.zeros(2, 3)}, {"v": torch.zeros(1)}], [{"w": [0, 0]}, None], "no DCP_SHARDING_INFO"),
        "omitted": ([{"w": torch.zeros(2, 3), "v": torch.zeros(1)}], [{"w": [0, 0]}], "no entry"),
        "hole": ([{"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3)}], [{"w": [0, 0]}, {"w": [3, 0]}], "missing"),
    }
    for name, (files, offsets, words) in cases.items():
        d = tmp_path / name
        d.mkdir()
        for i, (tensors, offs) in enumerate(zip(files, offsets), start=1):
            _shard(d / f"shard-{i:05d}-model-00001-of-00001.safetensors", tensors, offs)
        r = invoke("export", d, tmp_path / f"out_{name}")
        assert r.exit_code == 2 and words in r.stderr, (name, r.stderr)
        assert not (tmp_path / f"out_{name}").exists()
    assert staging_dirs(tmp_path) == []
