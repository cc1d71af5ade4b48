"""Issue 44: verify reads a DeepSpeed states file as the ZeRO source reads it. A sound ZeRO step
folder got ``pickle.unsafe_global`` (an error) for DeepSpeed's own loss scaler, stage enum and
fragment address, which the ZeRO reader accepts as data; now they are data in a file named as a
DeepSpeed states file, and only there. Any other global stays ``pickle.unsafe_global`` (and is
never run), in a states file too."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import torch

from tests.support.cli import run_ckptctl
from tests.test_zero_build import NEEDS_DEEPSPEED, step, zero_ckpts  # noqa: F401 - the fixture


def _findings(*paths: Path) -> dict[str, list[dict]]:
    r = run_ckptctl("verify", "--static", *paths, "--json", timeout=600)
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    return {res["path"]: res["findings"] for res in json.loads(r.stdout)["results"]}


def _unsafe(findings: list[dict]) -> list[dict]:
    return [f for f in findings if f["code"] == "pickle.unsafe_global"]


@NEEDS_DEEPSPEED
def test_no_step_folder_of_any_stage_gets_unsafe_global(zero_ckpts):
    folders = [step(root) for root in zero_ckpts.values()]
    files = sorted(f for d in folders for f in d.glob("*_states.pt"))
    assert any(f.name.startswith("bf16_") for f in files)  # the files that name fragment_address
    found = _findings(*folders, *files)
    assert len(found) == len(folders) + len(files)
    for path, findings in found.items():
        assert _unsafe(findings) == [], (path, findings)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_another_global_in_a_states_file_is_still_unsafe_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": _Evil(marker)}}, f)
    (found,) = _unsafe(_findings(f)[str(f)])
    assert found["severity"] == "error" and "system" in found["message"], found
    assert not marker.exists()


def test_a_deepspeed_global_outside_a_states_file_is_still_unsafe(tmp_path):
    f = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}X\x01\x00\x00\x00s"
                   b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n)Rs.")
        z.writestr("archive/version", "3\n")
    (found,) = _unsafe(_findings(f)[str(f)])
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in found["message"], found
