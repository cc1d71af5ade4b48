"""Issue 44: every pickle reader counts what it would build against a budget proportional to the
pickle's size, and refuses past it before building (``ckptctl.format.pickle_walk``).

The issue's payload: a 20 MB pickle of 20 million one-byte ``EMPTY_SET`` opcodes, which took
over 4 GiB (224 bytes per opcode byte) in ``verify --static``, ``inspect`` and ``export``; the
same payload as a ZeRO model-states file, Megatron's ``common.pt`` and a DCP ``.metadata`` (whose
reader had no walk at all). Each command runs in a real process under an address-space limit
(``RLIMIT_AS``) far below what the payload builds: one ``error:`` line and its hint, the
documented exit code, nothing published. Real files of each kind stay well inside the budget.
"""

from __future__ import annotations

import io
import json
import resource
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from tests.support.cli import run_ckptctl
from tests.test_megatron_build import NEEDS_MEGATRON, iteration, megatron_ckpts  # noqa: F401 - the fixture
from tests.test_zero_build import NEEDS_DEEPSPEED, step, zero_ckpts  # noqa: F401 - the fixture

SETS = 20_000_000
LIMIT = 1 << 30  # the command's address space: a quarter of what the payload builds unchecked
BUDGET = "more than a state dict of its size needs"


def _payload(n: int = SETS) -> bytes:
    return b"\x80\x02" + b"\x8f" * n + b"."  # PROTO 2, n x EMPTY_SET, STOP


def _archive(path: Path, pkl: bytes) -> None:
    """A ``torch.save``-shaped zip archive whose data.pkl is ``pkl``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _run(*args: object) -> subprocess.CompletedProcess:
    return run_ckptctl(*args, preexec_fn=_limited, timeout=600)


def _refused(r: subprocess.CompletedProcess, code: int = 2) -> None:
    assert r.returncode == code, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("hint:"), r.stderr[-2000:]
    assert BUDGET in lines[0], lines[0]


def test_a_torch_archive_of_twenty_million_empty_sets_is_refused_by_every_command(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    _archive(src / "pytorch_model.bin", _payload())
    _refused(_run("export", src, out, "--no-fsync"))
    assert not out.exists()
    _refused(_run("inspect", src))
    r = _run("verify", "--static", src, "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    (found,) = [f for f in json.loads(r.stdout)["results"][0]["findings"] if f["code"] == "pickle.unreadable"]
    assert BUDGET in found["message"], found


def test_a_compressed_data_pkl_is_walked_before_torch_inflates_it(tmp_path):
    """A deflated data.pkl (the payload in 20 KB): the records cannot map it, so torch.load read it,
    unbounded."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    with zipfile.ZipFile(src / "pytorch_model.bin", "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", _payload(), compress_type=zipfile.ZIP_DEFLATED)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    assert (src / "pytorch_model.bin").stat().st_size < 1 << 20
    _refused(_run("export", src, out, "--no-fsync"))
    assert not out.exists()


@NEEDS_DEEPSPEED
def test_a_zero_model_states_file_of_empty_sets_is_refused(zero_ckpts, tmp_path):
    folder, out = tmp_path / "global_step3", tmp_path / "out"
    shutil.copytree(step(zero_ckpts["s2_bf16"]), folder)
    _archive(folder / "mp_rank_00_model_states.pt", _payload())
    _refused(_run("export", folder, out, "--no-fsync"))
    assert not out.exists()


@NEEDS_MEGATRON
def test_a_megatron_common_pt_of_empty_sets_is_refused(megatron_ckpts, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(megatron_ckpts["llama_tp2"], src)
    _archive(iteration(src) / "common.pt", _payload())
    _refused(_run("export", src, out, "--no-fsync"))
    assert not out.exists()


def _dcp(root: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({f"layers.{i}.weight": torch.full((4, 4), float(i)) for i in range(4)}, checkpoint_id=str(root))


def test_a_dcp_metadata_of_empty_sets_is_refused(tmp_path):
    """The DCP reader's only check was ``pickletools.genops``: the payload passed it and was unpickled."""
    src, out = tmp_path / "src", tmp_path / "out"
    _dcp(src)
    (src / ".metadata").write_bytes(_payload())
    _refused(_run("export", src, out, "--no-fsync"))
    assert not out.exists()
    r = _run("verify", "--static", src, "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    (found,) = [f for f in json.loads(r.stdout)["results"][0]["findings"] if f["code"] == "dcp.bad_metadata"]
    assert BUDGET in found["message"], found


# ---- other amplifications, refused by the walk alone ------------------------------------------

def _memoised_calls() -> bytes:
    """``set(L)`` of one memoised 1,000-item list, 10,000 times: 8 bytes each, 32 KiB built each."""
    out = bytearray(b"\x80\x02cbuiltins\nset\nq\x00(")  # the callable as memo 0, then a MARK
    out += b"]q\x01(" + b"".join(b"J" + i.to_bytes(4, "little") for i in range(1000)) + b"e"  # L as memo 1
    out += b"h\x00h\x01\x85R0" * 10_000  # BINGET set, BINGET L, TUPLE1, REDUCE, POP
    return bytes(out + b"l.")  # LIST (to the MARK), STOP


def _memoised_states() -> bytes:
    """One memoised 1,000-entry dict given as the state of 10,000 new objects (BUILD copies it)."""
    out = bytearray(b"\x80\x02ccollections\nOrderedDict\nq\x00")
    out += b"}q\x01(" + b"".join(b"J" + i.to_bytes(4, "little") + b"N" for i in range(1000)) + b"u("
    out += b"h\x00)Rh\x01b0" * 10_000  # a new OrderedDict(), BUILD with the memoised dict, POP
    return bytes(out + b"l.")


_AMPLIFIERS = {
    "a memo index of two billion": b"\x80\x02Nr\x00\x00\x00\x80.",  # the C memo grows to 2**32 slots
    "set() of a memoised list": _memoised_calls(),
    "BUILD of a memoised state": _memoised_states(),
}


@pytest.mark.parametrize("name", sorted(_AMPLIFIERS))
def test_other_amplifications_are_refused_before_unpickling(name):
    from ckptctl.format.torch_pickle import load_pickles

    objs, unsafe, err = load_pickles(_AMPLIFIERS[name])
    assert objs == [] and err is not None and BUDGET in err, err


# ---- real files stay inside ----------------------------------------------------------------

def _data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _inside(data: bytes, records: bool = False) -> None:
    """A real pickle uses under half of the per-byte budget (the 32 MiB base aside)."""
    from ckptctl.format import pickle_walk as pw

    per_byte = pw.RECORDS_PER_BYTE if records else pw.MEMORY_PER_BYTE
    shape = pw._Shape(pw._BUDGET_BASE + pw._BUDGET_PER_BYTE * len(data), pw.memory_budget(len(data), per_byte))
    assert shape.walk(data, 0, io.BytesIO(data)) == len(data)
    assert shape.spent < per_byte * len(data) // 2


def test_real_torch_saves_and_dcp_metadata_stay_well_inside_the_budget(tmp_path):
    buf = io.BytesIO()
    torch.save({f"model.layers.{i}.mlp.up_proj.weight": torch.zeros(2, 3) for i in range(5000)}, buf)
    _inside(_data_pkl(buf))
    _dcp(tmp_path / "dcp")
    _inside((tmp_path / "dcp" / ".metadata").read_bytes(), records=True)
    from ckptctl.format.dcp_metadata import read_dcp_metadata

    md, findings = read_dcp_metadata(tmp_path / "dcp" / ".metadata", "x")
    assert findings == [] and len(md.state_dict_metadata) == 4


@NEEDS_DEEPSPEED
def test_real_zero_rank_files_stay_well_inside_the_budget(zero_ckpts):
    files = [f for name in zero_ckpts for f in sorted(step(zero_ckpts[name]).glob("*.pt"))]
    assert len(files) >= 20
    for f in files:
        _inside(_data_pkl(f))


@NEEDS_MEGATRON
def test_real_megatron_common_pt_stays_well_inside_the_budget(megatron_ckpts):
    for root in megatron_ckpts.values():
        _inside(_data_pkl(iteration(root) / "common.pt"))
