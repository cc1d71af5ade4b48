"""Export from ``torch.save`` archives and torch DCP without importing torch.

The records (:mod:`ckptctl.sources.torch_archive` for pickles, :mod:`ckptctl.format.dcp_metadata`
for DCP) replace the cross-check against ``torch.load(weights_only=True, mmap=True)``: here they
are compared with what torch loads from real files it saved, and every export through them is
compared byte for byte with the streaming path (torch's tensors in memory, ``dcp.load``). A
``python -X importtime`` run of the real CLI shows whether torch was imported: never on the fast
path, and only when a tensor must be gathered or converted. Hostile archives are refused with a
clear error and nothing in them runs.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from ckptctl.api import save_state_dict
from ckptctl.format import dtypes as dt
from ckptctl.format.dcp_metadata import MetadataIndex
from ckptctl.sources.dcp.source import read_dcp_metadata
from ckptctl.sources.torch_source import TorchSource, load_pickle
from tests.test_dcp_zero_copy import _files, _save_script, _save_two_ranks, _streamed

REPO = Path(__file__).resolve().parents[1]


def _ckptctl(*args: object) -> tuple[subprocess.CompletedProcess, bool]:
    """The real CLI in a fresh interpreter: (the process, whether it imported torch)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptctl", *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=300)
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    return p, "torch" in imported


def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dtypes() -> dict[str, torch.Tensor]:
    g = _gen()
    base = torch.randn(6, 5, generator=g)
    out = {f"t.{d}": base.to(getattr(torch, d)) for d in (
        "float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8",
        "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")}
    out["t.bool"] = base > 0
    out["t.complex64"] = torch.complex(base, -base)
    out["t.scalar"] = torch.tensor(2.5, dtype=torch.float64)  # 0-dim
    out["t.empty"] = torch.zeros(0, 3)
    out["t.empty_bf16"] = torch.zeros(4, 0, dtype=torch.bfloat16)
    return out


def _views() -> dict[str, torch.Tensor]:
    g = _gen(8)
    big = torch.randn(40, 12, generator=g)
    emb = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    return {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb,  # tied: the same storage and view, stored once
        "model.slice": big[5:20],  # contiguous views at storage offsets
        "model.rest": big[20:],
        "model.row": big[3],
        "model.same_storage_other_view": big[5:20].reshape(-1)[:30],
    }


def _strided() -> dict[str, torch.Tensor]:
    g = _gen(9)
    big = torch.randn(10, 12, generator=g)
    return {
        "a.contiguous": torch.randn(7, 3, generator=g),
        "b.transposed": torch.randn(12, 10, generator=g).t(),
        "c.columns": big[:, 2:5],
        "d.expanded": torch.randn(1, 4, generator=g).expand(3, 4),
    }


def _module_state() -> collections.OrderedDict:
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    sd = m.state_dict()  # an OrderedDict with a _metadata attribute
    assert hasattr(sd, "_metadata")
    return sd


def _parameters() -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(3)
    m = torch.nn.Linear(5, 3)
    return dict(m.named_parameters())  # pickled through torch._utils._rebuild_parameter


CASES = {
    "dtypes": (lambda: _dtypes(), None, False),
    "views_and_tied": (lambda: _views(), None, False),
    "strided": (lambda: _strided(), None, True),
    "ordered_dict_with_metadata": (lambda: _module_state(), None, False),
    "plain_dict": (lambda: dict(_module_state()), None, False),
    "parameters": (lambda: _parameters(), None, False),
    "nested_model": (lambda: {"model": _views(), "optimizer": {"step": 3, "lr": 0.1}, "epoch": 2}, "model", False),
    "nested_state_dict": (lambda: {"state_dict": {"inner": _module_state()}, "meta": "x"}, "state_dict.inner", False),
}


def _flat(obj: object, key: str | None) -> dict[str, torch.Tensor]:
    for part in key.split(".") if key else ():
        obj = obj[part]  # type: ignore[index]
    return dict(obj)  # type: ignore[call-overload]


@pytest.mark.parametrize("case", sorted(CASES))
def test_records_are_what_torch_loads(tmp_path, case):
    """The records of a file torch saved list the same tensors, aliases and order as torch's
    own load, and every contiguous tensor's bytes at the record's offset are torch's bytes."""
    make, key, _ = CASES[case]
    torch.save(make(), tmp_path / "pytorch_model.bin")
    fast = TorchSource.open(tmp_path, ["pytorch_model.bin"], key=key)
    slow = TorchSource._loaded(tmp_path, ["pytorch_model.bin"], "pytorch", key, True, {})
    assert fast.torch_loaded == [] and slow.torch_loaded == [str(tmp_path / "pytorch_model.bin")]
    assert [t.spec for t in fast.tensors] == [t.spec for t in slow.tensors]
    assert fast.aliases == slow.aliases
    loaded = load_pickle(tmp_path / "pytorch_model.bin", key)
    raw = (tmp_path / "pytorch_model.bin").read_bytes()
    for t in fast.tensors:
        want = loaded[t.name]
        assert (t.dtype, t.shape) == (dt.from_torch(want.dtype).name, tuple(want.shape)), t.name
        if want.is_contiguous() and want.numel():
            assert t.offset is not None, t.name
            assert raw[t.offset:t.offset + t.nbytes] == want.reshape(-1).view(torch.uint8).numpy().tobytes(), t.name
        else:
            assert t.offset is None, t.name


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_from_records_equals_streaming_and_imports_torch_only_to_gather(tmp_path, case):
    make, key, gathers = CASES[case]
    src = tmp_path / "src"
    src.mkdir()
    torch.save(make(), src / "pytorch_model.bin")
    args = ["--key", key] if key else []
    p, imported = _ckptctl("export", src, tmp_path / "fast", "--max-shard-size", "2KB", "--json", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    assert imported == gathers, "torch imported" if imported else "torch not imported for a view to gather"
    doc = json.loads(p.stdout)
    state = _flat(torch.load(src / "pytorch_model.bin", weights_only=True), key)
    stored = {k: v for k, v in state.items() if k not in doc["aliases"]}
    gathered = sum(v.numel() * v.element_size() for v in stored.values() if not v.is_contiguous())
    assert doc["bytes_streamed"] == gathered
    slow = save_state_dict(state, tmp_path / "slow", max_shard_size="2KB")  # in memory: every byte streamed
    assert slow.aliases == doc["aliases"]
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")


def test_sharded_pickles_tie_only_within_a_file(tmp_path):
    """Storage keys repeat across files (each archive starts at ``data/0``): a tensor of one
    shard is never taken for an alias of another shard's tensor."""
    a, b = torch.arange(6.0), torch.arange(6.0) + 1
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"x": a}, src / "pytorch_model-00001-of-00002.bin")
    torch.save({"y": b}, src / "pytorch_model-00002-of-00002.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"x": "pytorch_model-00001-of-00002.bin", "y": "pytorch_model-00002-of-00002.bin"}}))
    p, imported = _ckptctl("export", src, tmp_path / "out", "--json")
    assert p.returncode == 0 and not imported, p.stderr[-2000:]
    assert json.loads(p.stdout)["aliases"] == {}
    from safetensors.torch import load_file

    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["x"], a) and torch.equal(out["y"], b)


@pytest.mark.parametrize("obj, key, message", [
    (lambda: torch.zeros(3), None, "holds a Tensor, not a state dict"),
    (lambda: {"w": torch.zeros(2), "step": 3}, None, "mixes tensors with non-tensor entries (step)"),
    (lambda: {"model": _views(), "step": 3}, None, "no tensors at the top level (keys: model, step)"),
    (lambda: {"model": _views(), "step": 3}, "optim", "no key 'optim' in the checkpoint"),
    (lambda: {"state": {"step": 3}}, "state", "no tensors at the top level (keys: step)"),
])
def test_what_is_not_a_state_dict_is_refused_as_before(tmp_path, obj, key, message):
    """The records path refuses with the words the torch path used (both go through ``select``)."""
    from ckptctl.errors import InputError
    from ckptctl.sources.torch_archive import read_archive

    torch.save(obj(), tmp_path / "pytorch_model.bin")
    for read in (read_archive, load_pickle):
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read(tmp_path / "pytorch_model.bin", key)


def test_conversion_imports_torch_and_equals_streaming(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    sd = _views()
    torch.save(sd, src / "pytorch_model.bin")
    p, imported = _ckptctl("export", src, tmp_path / "fast", "--dtype", "fp16")
    assert p.returncode == 0 and imported, p.stderr[-2000:]
    save_state_dict(torch.load(src / "pytorch_model.bin", weights_only=True), tmp_path / "slow", dtype="fp16")
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")


def test_legacy_format_goes_to_torch(tmp_path):
    """A pre-1.6 (non-zip) file has no records: torch decides, as before (it cannot map it)."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save(_views(), src / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    p, imported = _ckptctl("export", src, tmp_path / "out")
    assert imported and p.returncode == 2, p.stderr[-2000:]
    assert "legacy (pre-zipfile) torch.save format" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


# -- hostile archives: refused without torch, nothing run -----------------------------------------


def _archive(path: Path, pkl: bytes, records: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
        for k, v in records.items():
            z.writestr(f"archive/data/{k}", v)


class _Tensor:
    """Pickles as torch.save pickles a tensor: ``_rebuild_tensor_v2`` of a persistent storage."""

    def __init__(self, numel: int, size: tuple[int, ...], offset: int = 0) -> None:
        self.pid = ("storage", torch.FloatStorage, "0", "cpu", numel)
        self.size, self.offset = size, offset

    def __reduce__(self):
        stride = tuple(int(torch.tensor(self.size[i + 1:]).prod()) for i in range(len(self.size)))
        return (torch._utils._rebuild_tensor_v2,
                (_Storage(self.pid), self.offset, self.size, stride, False, collections.OrderedDict()))


class _Storage:
    def __init__(self, pid: tuple) -> None:
        self.pid = pid


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Storage) else None


def _pickled(obj: object) -> bytes:
    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _export_refused(tmp_path: Path, match: str) -> None:
    p, imported = _ckptctl("export", tmp_path / "src", tmp_path / "out")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and match in p.stderr, p.stderr[-2000:]
    assert not imported, "torch was imported to refuse a hostile archive"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("global_", ["os system", "builtins eval", "torch load", "__main__ Evil"])
def test_an_archive_naming_a_global_outside_the_allow_list_is_refused_and_never_run(tmp_path, global_):
    marker = tmp_path / "pwned"
    (tmp_path / "src").mkdir()
    module, name = global_.split()
    pkl = f"c{module}\n{name}\n(V".encode() + f"touch {marker}".encode() + b"\ntR."
    _archive(tmp_path / "src" / "pytorch_model.bin", pkl, {})
    _export_refused(tmp_path, f"refused to unpickle: it references {module}.{name}")
    assert not marker.exists()


def _tuple_bomb(width: int, depth: int) -> bytes:
    """A dict keyed by a tuple of ``width`` references to a tuple of ``width`` references ...,
    ``depth`` levels: 319 bytes at 20 and 7, whose hash visits 20**7 tuples."""
    out = bytearray(b"\x80\x02)q\x00")  # PROTO 2, EMPTY_TUPLE, BINPUT 0
    for i in range(depth):
        out += b"(" + (b"h" + bytes([i])) * width + b"tq" + bytes([i + 1])  # MARK, BINGET i * width, TUPLE, BINPUT
    return bytes(out + b"}h" + bytes([depth]) + b"Ns.")  # EMPTY_DICT, BINGET depth, NONE, SETITEM, STOP


_BOMBS = {
    "memoised tuples hashed as a key": (_tuple_bomb(20, 7), "repeat more objects by memo reference"),
    "a tuple two million deep hashed as a key": (b"\x80\x02})" + b"\x85" * 2_000_000 + b"Ns.", "nest more than 1000 deep"),
    "lists five thousand deep": (b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b".", "nest more than 1000 deep"),
}


@pytest.mark.parametrize("bomb", sorted(_BOMBS))
def test_a_pickle_too_costly_to_hash_is_refused_before_it_is_unpickled(tmp_path, bomb):
    """Before the opcode model, the first bomb took minutes in verify and export, the second
    crashed the process (CPython hashes nested tuples by C recursion)."""
    from ckptctl.format.torch_pickle import load_pickles

    pkl, why = _BOMBS[bomb]
    objs, unsafe, err = load_pickles(pkl)
    assert objs == [] and unsafe == [] and err is not None and why in err
    (tmp_path / "src").mkdir()
    _archive(tmp_path / "src" / "pytorch_model.bin", pkl, {})
    _export_refused(tmp_path, why)
    p, imported = _ckptctl("verify", tmp_path / "src" / "pytorch_model.bin", "--json")
    assert p.returncode == 1 and not imported, p.stderr[-2000:]
    codes = {f["code"]: f["message"] for f in json.loads(p.stdout)["results"][0]["findings"]}
    assert why in codes["pickle.unreadable"]


def test_a_large_plain_state_dict_stays_well_inside_the_budget() -> None:
    """What torch.save writes for 20,000 tensors uses a small part of what a pickle may charge."""
    import io

    from ckptctl.format import pickle_walk as pw
    from ckptctl.format import torch_pickle as tp

    buf = io.BytesIO()
    torch.save(collections.OrderedDict((f"layer.{i}.weight", torch.zeros(2)) for i in range(20_000)), buf)
    with zipfile.ZipFile(buf) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    budget = pw._BUDGET_BASE + pw._BUDGET_PER_BYTE * len(data)
    shape = pw._Shape(budget, pw.memory_budget(len(data)))
    assert shape.walk(data, 0, io.BytesIO(data)) == len(data)
    assert budget - shape.budget < budget // 20
    assert shape.spent < pw.MEMORY_PER_BYTE * len(data) // 2  # the memory it may take: under half
    objs, unsafe, err = tp.load_pickles(data)
    assert err is None and unsafe == [] and len(objs[0]) == 20_000


def test_an_archive_without_a_version_record_is_refused_as_torch_refuses_it(tmp_path):
    (tmp_path / "src").mkdir()
    with zipfile.ZipFile(tmp_path / "src" / "pytorch_model.bin", "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", _pickled({"w": _Tensor(4, (4,))}))
        z.writestr("archive/data/0", b"\0" * 16)
    with pytest.raises(RuntimeError, match="version"):
        torch.load(tmp_path / "src" / "pytorch_model.bin", weights_only=True)
    _export_refused(tmp_path, "the zip archive has no version record")


def test_a_truncated_archive_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    torch.save(_views(), tmp_path / "whole.bin")
    raw = (tmp_path / "whole.bin").read_bytes()
    (tmp_path / "src" / "pytorch_model.bin").write_bytes(raw[:len(raw) // 2])
    _export_refused(tmp_path, "damaged zip archive")


def test_a_storage_record_shorter_than_its_storage_is_refused(tmp_path):
    """torch maps ``numel`` elements from the record's start whatever the record's size: it would
    read the bytes of the records after it. The records reader refuses."""
    (tmp_path / "src").mkdir()
    _archive(tmp_path / "src" / "pytorch_model.bin", _pickled({"w": _Tensor(100, (10, 10))}),
             {"0": b"\0" * 16})
    _export_refused(tmp_path, "holds 16 bytes, its storage needs 400 (torch would read past the record)")


def test_a_view_past_the_end_of_its_storage_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    _archive(tmp_path / "src" / "pytorch_model.bin", _pickled({"w": _Tensor(4, (2, 2), offset=2)}),
             {"0": b"\0" * 16})
    _export_refused(tmp_path, "reaches past the end of its 16-byte storage")


def test_a_handmade_archive_of_plain_tensors_is_read(tmp_path):
    """The same builder, within bounds, makes an archive torch and the records agree on (so the
    two refusals above are about the bounds, not about the builder)."""
    (tmp_path / "src").mkdir()
    data = torch.arange(16, dtype=torch.float32)
    _archive(tmp_path / "src" / "pytorch_model.bin", _pickled({"w": _Tensor(16, (2, 4), offset=8)}),
             {"0": data.numpy().tobytes()})
    assert torch.equal(torch.load(tmp_path / "src" / "pytorch_model.bin", weights_only=True)["w"],
                       data[8:].reshape(2, 4))
    p, imported = _ckptctl("export", tmp_path / "src", tmp_path / "out")
    assert p.returncode == 0 and not imported, p.stderr[-2000:]
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], data[8:].reshape(2, 4))


# -- DCP ------------------------------------------------------------------------------------------


def _model_and_optimizer() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    names = [n for n, _ in m.named_parameters()]
    optim = {f"{names[i]}.{k}": v for i, st in osd["state"].items() for k, v in st.items()}
    return {"model": dict(m.state_dict()), "optimizer": optim}


def _same_metadata(records: object, theirs: object) -> None:
    """Our records say what torch's own Metadata says, entry by entry."""
    from torch.distributed.checkpoint.metadata import MetadataIndex as TorchIndex
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    assert list(records.state_dict_metadata) == list(theirs.state_dict_metadata)
    for fqn, item in theirs.state_dict_metadata.items():
        ours = records.state_dict_metadata[fqn]
        assert type(ours).__name__ == type(item).__name__, fqn
        if isinstance(item, TensorStorageMetadata):
            assert str(item.properties.dtype) == f"torch.{ours.properties.dtype.torch_name}", fqn
            assert tuple(ours.size) == tuple(item.size), fqn
            assert [(tuple(c.offsets), tuple(c.sizes)) for c in ours.chunks] == \
                [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks], fqn
            keys = [(TorchIndex(fqn, c.offsets), MetadataIndex(fqn, c.offsets)) for c in item.chunks]
        else:
            keys = [(TorchIndex(fqn), MetadataIndex(fqn))]
        for theirs_key, our_key in keys:
            a, b = theirs.storage_data[theirs_key], records.storage_data[our_key]
            assert (str(a.relative_path), a.offset, a.length) == (str(b.relative_path), b.offset, b.length), fqn
    assert len(records.storage_data) == len(theirs.storage_data)


def _check_dcp_exports(src: Path, tmp_path: Path, keys: dict[str, bool]) -> None:
    """Each ``--key``'s export through the real CLI equals the streaming path (``dcp.load`` per
    tensor) byte for byte; torch is imported exactly when ``keys`` says a tensor is gathered."""
    for key, gathers in keys.items():
        p, imported = _ckptctl("export", src, tmp_path / f"fast-{key}", "--key", key, "--max-shard-size", "2KB")
        assert p.returncode == 0, p.stderr[-2000:]
        assert imported == gathers, (key, imported)
        _streamed(src, tmp_path / f"slow-{key}", key=key, max_shard_size="2KB")
        assert _files(tmp_path / f"fast-{key}") == _files(tmp_path / f"slow-{key}"), key


def test_one_rank_dcp_model_and_optimizer(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    state = _model_and_optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**state, "step": 7}, checkpoint_id=src, no_dist=True)
    _same_metadata(read_dcp_metadata(src), read_dcp_metadata(src, torch_classes=True))
    _check_dcp_exports(src, tmp_path, {"model": False, "optimizer": False})


_SAVE_TRAINING = _save_script(
    "from tests.test_torch_records import _model_and_optimizer\n"
    "st = _model_and_optimizer()\n"
    "out = {group: {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() >= 1 and v.shape[0] >= 2 else v\n"
    "               for k, v in sd.items()} for group, sd in st.items()}\n"
    "if sys.argv[2] == 'columns':\n"
    "    w = st['model']['0.weight']\n"
    "    out['model']['0.weight'] = distribute_tensor(w, mesh, [Shard(1)])\n"
    "out['step'] = 7\n"
    "dcp.save(out, checkpoint_id=sys.argv[1])\n")


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_two_rank_gloo_dcp_model_and_optimizer(tmp_path, layout):
    """Row shards are contiguous runs: no torch. A column-sharded weight's chunks are strided:
    that one tensor goes through ``dcp.load``, which imports torch."""
    src = tmp_path / "dcp"
    _save_two_ranks(_SAVE_TRAINING.replace("sys.argv[2]", repr(layout)), src)
    _same_metadata(read_dcp_metadata(src), read_dcp_metadata(src, torch_classes=True))
    _check_dcp_exports(src, tmp_path, {"model": layout == "columns", "optimizer": False})


def test_dcp_of_every_dtype_is_copied_without_torch(tmp_path):
    """Chunks of dtypes without a legacy storage class (uint16, float8: ``_rebuild_tensor_v3`` of
    an untyped storage) are contiguous runs too, copied by the kernel like the others."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    state = _dtypes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=src, no_dist=True)
    _same_metadata(read_dcp_metadata(src), read_dcp_metadata(src, torch_classes=True))
    p, imported = _ckptctl("export", src, tmp_path / "fast", "--json")
    assert p.returncode == 0 and not imported, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert doc["bytes_streamed"] == 0
    assert doc["bytes_copied_by_kernel"] + doc["bytes_cloned"] == sum(v.numel() * v.element_size() for v in state.values())
    _streamed(src, tmp_path / "slow")
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")
