"""Options are validated before any I/O: a bad option changes nothing on disk, not even the
recovery of a dead writer's half-done publish (real processes, real files)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from ckptctl import ExportOptions, save_state_dict
from ckptctl.errors import UsageError
from ckptctl.write.options import ExportSettings, validate
from tests.support import load_glob as load_dir
from tests.support import run_ckptctl, same, staging_dirs, state, write_single


def _half_done_two_rename(tmp_path: Path) -> tuple[Path, Path, dict, dict]:
    """A writer killed between the two renames of an exchange-less publish: the destination is
    gone, its old version sits in the staging directory's old/, the new one (ready) in data/."""
    old, new = state(1), state(2)
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_single(src, new)
    write_single(dst, old)
    p = run_ckptctl("export", str(src), str(dst), "--overwrite",
                    env={"CKPTCTL_FAIL_AT": "exchange:EINVAL", "CKPTCTL_KILL_AT": "two-rename-between"})
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not os.path.lexists(dst)
    [stage] = staging_dirs(tmp_path)
    assert sorted(os.listdir(stage)) == ["data", "lock", "old", "owner.json", "ready"]
    return src, dst, old, new


@pytest.mark.parametrize("bad", [["--max-shard-size", "5XB"], ["--max-shard-size", "0"], ["--dtype", "fp8"],
                                 ["--only", "everything"], ["--key", "state_dict..model"]])
def test_bad_option_is_refused_before_any_io(tmp_path, bad):
    src, dst, old, new = _half_done_two_rename(tmp_path)
    before = {p.name: sorted(os.listdir(p)) for p in staging_dirs(tmp_path)}
    p = run_ckptctl("export", str(src), str(dst), "--overwrite", "--json", *bad)
    assert p.returncode == 2, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is False and bad[1] in doc["error"]["message"], doc
    assert "Traceback" not in p.stderr
    # the half-done publish was left exactly as it was: nothing renamed, nothing removed
    assert not os.path.lexists(dst)
    assert {p.name: sorted(os.listdir(p)) for p in staging_dirs(tmp_path)} == before
    # and a valid run recovers it (rolled forward: the dead writer's new version was ready), then writes
    p = run_ckptctl("export", str(src), str(dst), "--overwrite", "--json", check=True)
    assert [r.split(": ")[1] for r in json.loads(p.stdout)["recovered"]] == ["rolled-forward"]
    assert same(load_dir(dst), new) and staging_dirs(tmp_path) == []


def test_library_options_are_refused_before_any_io(tmp_path):
    dst = tmp_path / "dst"
    write_single(dst, state(1))
    before = sorted(os.listdir(dst))
    for bad in ({"max_shard_size": 0}, {"max_shard_size": -5}, {"max_shard_size": True}, {"dtype": "int8"},
                {"prefix": "../escaped"}, {"prefix": ""}):
        with pytest.raises(UsageError):
            save_state_dict({"a": torch.ones(4)}, dst, overwrite=True, **bad)
    assert sorted(os.listdir(dst)) == before and sorted(os.listdir(tmp_path)) == ["dst"]


def test_validate_parses_every_option():
    assert validate(ExportOptions()) == ExportSettings(5_000_000_000, None)
    assert validate(ExportOptions(max_shard_size=None, dtype="keep")) == ExportSettings(5_000_000_000, None)
    assert validate(ExportOptions(max_shard_size="2GiB", dtype="bf16"), only="pytorch", key="state_dict") == \
        ExportSettings(2 * 2**30, "BF16", "pytorch", "state_dict")
    assert validate(ExportOptions(max_shard_size=123, dtype="fp16"), key="") == ExportSettings(123, "F16")
    assert validate(ExportOptions(dtype="fp32"), only="index").target_dtype == "F32"
    for opts, kw in ((ExportOptions(max_shard_size="5 parsecs"), {}), (ExportOptions(max_shard_size="0.1B"), {}),
                     (ExportOptions(dtype="float16"), {}), (ExportOptions(), {"only": "pickle"}),
                     (ExportOptions(), {"key": ".model"}), (ExportOptions(prefix="a/b"), {})):
        with pytest.raises(UsageError):
            validate(opts, **kw)


@pytest.mark.parametrize("bad", [["--max-shard-size", "5XB"], ["--dtype", "fp8"], ["--repair", "--prefer", "newest"]])
def test_resave_refuses_a_bad_option_before_any_io(tmp_path, bad):
    """resave recovers its directory's half-done publish first, but never on a bad option."""
    src, dst, old, new = _half_done_two_rename(tmp_path)
    before = {p.name: sorted(os.listdir(p)) for p in staging_dirs(tmp_path)}
    p = run_ckptctl("resave", str(dst), "--json", *bad)
    assert p.returncode == 2, p.stderr
    assert json.loads(p.stdout)["ok"] is False and "Traceback" not in p.stderr
    assert not os.path.lexists(dst)
    assert {p.name: sorted(os.listdir(p)) for p in staging_dirs(tmp_path)} == before
