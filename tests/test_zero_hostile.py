"""Broken and hostile ZeRO checkpoints: a clear one-line error naming the rank, exit 2, nothing
published, nothing run. Each case breaks a copy of a real checkpoint (``tests/test_zero_build.py``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import invoke, staging_dirs
from tests.test_zero_build import NEEDS_DEEPSPEED, ckpt, step, zero_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_DEEPSPEED


class _Evil:
    """Pickled as a call of ``os.system``: reading the file must never run it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _optim(folder: Path, rank: int) -> Path:
    (f,) = folder.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return f


def _missing_rank(folder: Path, tmp: Path) -> str:
    _optim(folder, 1).unlink()
    return "rank 1's optimizer states file zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"


def _truncated_rank(folder: Path, tmp: Path) -> str:
    f = _optim(folder, 1)
    os.truncate(f, f.stat().st_size // 2)
    return f"rank 1's optimizer states file {f} is truncated or damaged"


def _missing_model_states(folder: Path, tmp: Path) -> str:
    (folder / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    return "rank 1's model states file zero_pp_rank_1_mp_rank_00_model_states.pt is missing"


def _extra_rank(folder: Path, tmp: Path) -> str:
    shutil.copy(_optim(folder, 1), folder / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    return "optimizer states files for 3 ranks, but rank 0's says the world size was 2"


def _rank_of_another_run(folder: Path, tmp: Path) -> str:
    # rank 1's file from a stage 1 run of another model: the ranks disagree
    other = step(tmp / "other")
    shutil.copy(_optim(other, 1), _optim(folder, 1))
    return "rank 1's optimizer states say ZeRO stage 1 with 2 ranks, rank 0's stage 3 with 2: mismatched"


def _latest_names_missing_step(folder: Path, tmp: Path) -> str:
    (folder.parent / "latest").write_text("global_step9")
    return "latest names step 'global_step9', which is not in"


def _unsafe_global(folder: Path, tmp: Path) -> str:
    torch.save({"optimizer_state_dict": {"zero_stage": _Evil(tmp / "ran")}}, _optim(folder, 1))
    return "refused to unpickle: it references posix.system, outside the allow-list"


CASES = {f.__name__[1:]: f for f in (_missing_rank, _truncated_rank, _missing_model_states, _extra_rank,
                                     _rank_of_another_run, _latest_names_missing_step, _unsafe_global)}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_zero_checkpoint_is_refused_and_nothing_is_published(zero_ckpts, tmp_path, case):
    src = tmp_path / "run"
    shutil.copytree(ckpt(zero_ckpts["s3_fp32"]), ckpt(src))
    shutil.copytree(ckpt(zero_ckpts["s1_fp32"]), ckpt(tmp_path / "other"))
    expect = CASES[case](step(src), tmp_path)
    for arg in (ckpt(src), step(src)) if case != "latest_names_missing_step" else (ckpt(src),):
        r = invoke("export", arg, tmp_path / "hf")
        assert r.exit_code == 2, r.stdout + r.stderr
        assert expect in r.stderr.replace("\n", " "), r.stderr
        assert "Traceback" not in r.stderr and "hint: " in r.stderr
        assert not (tmp_path / "hf").exists() and staging_dirs(tmp_path) == []
        r = invoke("inspect", arg, "--json")  # the same error, as one JSON document
        assert r.exit_code == 2 and expect in json.loads(r.stdout)["error"]["message"], r.stdout + r.stderr
        r = invoke("verify", arg, "--json")  # a finding: the checkpoint cannot be exported
        found = [f for res in json.loads(r.stdout)["results"] for f in res["findings"] if f["code"] == "zero.damaged"]
        assert r.exit_code == 1 and len(found) == 1 and found[0]["code"] == "zero.damaged", r.stdout + r.stderr
        assert expect in found[0]["message"]
    assert not (tmp_path / "ran").exists()


def test_a_directory_with_a_stray_latest_file_is_not_taken_for_deepspeed(tmp_path):
    from tests.support import write_tiny_checkpoint

    d = write_tiny_checkpoint(tmp_path / "ckpt")
    (d / "latest").write_text("v2")
    r = invoke("export", d, tmp_path / "out")
    assert r.exit_code == 0, r.stdout + r.stderr


def test_deepspeeds_globals_are_data_only_to_the_zero_reader(zero_ckpts):
    """The torch-pickle reader refuses DeepSpeed's globals (a plain export of a rank file); the
    ZeRO reader reads them as records (the stage enum's value), and neither imports deepspeed (in
    a fresh process: another test of the session may have imported it)."""
    import subprocess
    import sys

    f = _optim(step(zero_ckpts["s3_fp32"]), 0)
    code = (
        "import json, sys, zipfile\n"
        "from ckptctl.format.torch_pickle import DEEPSPEED_GLOBALS, load_pickles\n"
        "with zipfile.ZipFile(sys.argv[1]) as z:\n"
        "    raw = z.read(next(n for n in z.namelist() if n.endswith('/data.pkl')))\n"
        "_, plain, err1 = load_pickles(raw)\n"
        "(obj,), unsafe, err2 = load_pickles(raw, data_globals=DEEPSPEED_GLOBALS)\n"
        "stage = obj['optimizer_state_dict']['zero_stage']\n"
        "print(json.dumps([plain, err1, unsafe, err2, stage.global_name, stage.value, 'deepspeed' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, check=True).stdout
    plain, err1, unsafe, err2, name, value, imported = json.loads(out)
    assert err1 is None and "deepspeed.runtime.zero.config.ZeroStageEnum" in plain
    assert err2 is None and unsafe == []
    assert name == "deepspeed.runtime.zero.config.ZeroStageEnum" and value == 3
    assert not imported
