"""Small untruths of the screens (issue 46), each pinned by its words: sizes said after the write,
only the copy methods that happened, plurals, long name lists cut, the owner record's real command
line, inspect --filter's files, config values as the file has them, /proc not a real filesystem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptctl.staging.record import command_line
from tests.support import run_ckptctl, staging_dirs, state
from tests.support.builders import write_config, write_sharded


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    write_sharded(d, state(1, n=10), per_shard=1)
    write_config(d, architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    return d


def test_export_says_written_after_the_write_and_only_what_happened(src: Path, tmp_path: Path) -> None:
    dry = run_ckptctl("export", src, tmp_path / "out", "--dry-run")
    assert dry.returncode == 0 and " to write (" in dry.stdout and " written" not in dry.stdout
    r = run_ckptctl("export", src, tmp_path / "out", "--no-fsync")
    assert r.returncode == 0, r.stderr
    assert " written\n" in r.stdout and " to write" not in r.stdout
    doc = json.loads(run_ckptctl("export", src, tmp_path / "again", "--no-fsync", "--json").stdout)
    r = run_ckptctl("export", src, tmp_path / "again", "--no-fsync", "--overwrite")
    assert "0 bytes" not in r.stdout
    assert ("cloned" in r.stdout) == (doc["bytes_cloned"] > 0)


def test_many_removed_names_are_one_short_line(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    assert run_ckptctl("export", src, dst, "--no-fsync", "--max-shard-size", "keep").returncode == 0
    shards = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    assert len(shards) == 10
    r = run_ckptctl("resave", dst, "--max-shard-size", "1GB", "--no-fsync")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("removed from the old version: "))
    assert line.endswith(" and 3 more (--json lists them all)") and line.count(", ") == 7


def test_plurals(tmp_path: Path, src: Path) -> None:
    (src / "model-00010-of-00010.safetensors").write_bytes(b"")
    r = run_ckptctl("verify", "--static", src)
    assert r.returncode == 1 and "(1 error, 0 warnings, " in r.stderr and " 1 errors" not in r.stderr
    leak = tmp_path / "gc" / "_tmp_ckpt.18ecc906440da92e-4404158d"
    leak.mkdir(parents=True)
    (leak / "owner.json").write_text(json.dumps({"tool": "ckptctl", "pid": 1 << 22, "host": "node-9.invalid"}))
    r = run_ckptctl("gc-tmp", "--check", "--older-than", "0s", "--min-age", "0", tmp_path / "gc")
    assert r.returncode == 1 and "hint: 1 leftover found; " in r.stderr and "(s)" not in r.stderr


def test_owner_record_keeps_the_real_command_line(src: Path, tmp_path: Path) -> None:
    assert command_line(["/venv/bin/ckptctl", "export", "a b", "c", "--dtype", "bf16"]) == \
        "ckptctl export 'a b' c --dtype bf16"
    assert command_line(["/repo/ckptctl/__main__.py", "resave", "d"]) == "ckptctl resave d"
    assert command_line(["/usr/bin/python3", "-c", "x"]) == "/usr/bin/python3 -c x"
    dst = tmp_path / "my out"
    r = run_ckptctl("export", src, dst, "--dtype", "bf16", "--manifest", env={"CKPTCTL_KILL_AT": "sealed"})
    assert r.returncode == -9
    (stage,) = staging_dirs(tmp_path)
    owner = json.loads((stage / "owner.json").read_text())
    assert owner["command"] == f"ckptctl export {src} '{dst}' --dtype bf16 --manifest"


def test_inspect_filter_lists_the_matching_shards_and_config_as_written(src: Path) -> None:
    r = run_ckptctl("inspect", src, "--filter", "*.0.*")
    assert r.returncode == 0, r.stderr
    shards = [line for line in r.stdout.splitlines() if "-of-00010.safetensors" in line and "weights" in line]
    assert len(shards) == 1, r.stdout
    assert "LlamaForCausalLM" in r.stdout and "['LlamaForCausalLM']" not in r.stdout
    assert "tie_word_embeddings  false" in r.stdout


def test_proc_is_not_a_real_filesystem(src: Path) -> None:
    if os.statvfs("/proc").f_blocks != 0:
        pytest.skip("/proc has blocks here")
    r = run_ckptctl("export", src, "/proc/ckptctl-test")
    assert r.returncode == 3 and r.stderr.startswith("error: /proc is not a real filesystem")
    assert "free space" not in r.stderr
