"""Issue 44: the config.json an export writes holds finite numbers only. JSON has no NaN or
Infinity, yet Python's ``json`` reads and writes them (and ``1e999`` reads as infinity): a source
config.json holding one, or a Megatron checkpoint whose arguments give ``rotary_base`` infinity,
was published as a config every loader builds a broken model from. Refused before anything is
written: one ``error:`` line naming the field, a hint, exit 2, nothing published."""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from tests.support.builders import state, write_sharded
from tests.support.cli import run_ckptctl
from tests.test_megatron_build import NEEDS_MEGATRON, iteration, megatron_ckpts  # noqa: F401 - the fixture

CONFIGS = {
    "Infinity": ('{"model_type": "llama", "rope_theta": Infinity}', "rope_theta is inf"),
    "NaN in a sub-config": ('{"model_type": "llava", "text_config": {"model_type": "llama", "rms_norm_eps": NaN}}',
                            "text_config.rms_norm_eps is nan"),
    "a literal past the float range": ('{"model_type": "llama", "rope_scaling": {"factor": [1, -1e999]}}',
                                       "rope_scaling.factor[1] is -inf"),
}


def _refused(r, out: Path, needle: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("hint:"), r.stderr
    assert needle in lines[0] and "not a finite number" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_config_json_with_a_number_that_is_not_finite_is_refused(tmp_path, case):
    text, needle = CONFIGS[case]
    src, out = tmp_path / "src", tmp_path / "out"
    write_sharded(src, state(1, n=2, rows=4, cols=4), per_shard=1)
    (src / "config.json").write_text(text)
    _refused(run_ckptctl("export", src, out, "--no-fsync"), out, needle)


def test_a_finite_config_json_is_carried(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_sharded(src, state(1, n=2, rows=4, cols=4), per_shard=1)
    (src / "config.json").write_text('{"model_type": "llama", "rope_theta": 1e6, "rms_norm_eps": 1e-300}')
    r = run_ckptctl("export", src, out, "--no-fsync")
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


@NEEDS_MEGATRON
def test_a_megatron_rotary_base_of_infinity_is_refused(megatron_ckpts, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(megatron_ckpts["llama_tp2"], src)
    common = iteration(src) / "common.pt"
    old = zipfile.ZipFile(common)
    members = {i.filename: old.read(i) for i in old.infolist()}
    old.close()
    (pkl,) = [n for n in members if n.endswith("/data.pkl")]
    data = members[pkl]
    at = data.index(b"rotary_base")
    value = data.index(b"G", at)  # BINFLOAT: 8 bytes, big-endian
    members[pkl] = data[:value + 1] + struct.pack(">d", float("inf")) + data[value + 9:]
    with zipfile.ZipFile(common, "w", zipfile.ZIP_STORED) as z:
        for name, blob in members.items():
            z.writestr(name, blob)
    _refused(run_ckptctl("export", src, out, "--no-fsync"), out, "rope_theta = inf")
