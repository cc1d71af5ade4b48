"""The output contract under hostile use (issue 15), on real processes: usage errors with --json,
a reader that closes the pipe, -q in cron, tables in pipes, a file that vanishes mid-operation,
destination names no staging directory can be made for, a full disk's message. Signals are in
test_crash_signals.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptctl import errors as E
from tests.support import (CKPTCTL, clean_env, popen_ckptctl, run_ckptctl, state, wait_stopped, write_config,
                           write_sharded)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    write_sharded(tmp_path / "src", state(1, n=6), per_shard=2)
    write_config(tmp_path / "src")
    return tmp_path / "src"


def _one_document(stdout: str) -> dict:
    doc = json.loads(stdout)  # exactly one document: json.loads refuses anything after it
    assert stdout.count("\n") == 1 and doc["schema_version"] == 1 and doc["ok"] is False
    return doc


# ---------------------------------------------------------------------------------------------
# --json usage errors: one document too


@pytest.mark.parametrize("args,command,words", [
    (["export", "--json", "--bogus", "{src}", "{tmp}/d"], "export", "no such option: --bogus"),
    (["export", "{src}", "--json"], "export", "missing argument DST"),
    (["gc-tmp", "--json", "--min-age"], "gc-tmp", "--min-age"),
    (["verify", "--json", "--fail-on", "never", "{src}"], "verify", "--fail-on"),
    (["inspect", "--json", "{src}", "extra"], "inspect", "unexpected extra argument"),
    (["--json"], "ckptctl", "no such option: --json"),
])
def test_a_usage_error_with_json_is_one_json_document(ckpt, tmp_path, args, command, words):
    argv = [a.format(src=ckpt, tmp=tmp_path) for a in args]
    r = run_ckptctl(*argv)
    assert r.returncode == 2, r.stderr
    doc = _one_document(r.stdout)
    assert doc["command"] == command
    err = doc["error"]
    assert (err["code"], err["exit_code"]) == ("usage", 2) and words in err["message"], err
    assert err["hint"] == ("ckptctl -h" if command == "ckptctl" else f"ckptctl {command} -h")
    assert words in r.stderr and "Traceback" not in r.stderr


def test_a_usage_error_without_json_is_the_house_form(ckpt, tmp_path):
    r = run_ckptctl("export", "--bogus", ckpt, tmp_path / "d")
    assert r.returncode == 2 and r.stdout == ""
    first, hint = r.stderr.splitlines()
    assert first.startswith("error: no such option: --bogus") and hint == "hint: ckptctl export -h"


def test_version_and_help_still_exit_0():
    for args in (["--version"], ["export", "--help"]):
        r = run_ckptctl(*args)
        assert r.returncode == 0 and r.stdout and r.stderr == "", r.stderr


# ---------------------------------------------------------------------------------------------
# a reader that goes away: exit 141, quietly


@pytest.mark.parametrize("args", [["inspect", "{src}", "--tensors"], ["inspect", "{src}", "--json"],
                                  ["verify", "{src}"]])
def test_a_closed_stdout_exits_141_quietly(ckpt, args):
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # the reader is gone before the first byte: every write gets EPIPE
    try:
        proc = subprocess.run([*CKPTCTL, *[a.format(src=ckpt) for a in args]], stdout=w_fd,
                              stderr=subprocess.PIPE, text=True, env=clean_env(), timeout=120)
    finally:
        os.close(w_fd)
    assert proc.returncode == E.EXIT_BROKEN_PIPE == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr and "error:" not in proc.stderr


def test_head_1_in_a_shell_pipeline(ckpt):
    proc = subprocess.run(["bash", "-c", f'{sys.executable} -m ckptctl inspect "$1" --tensors | head -1; '
                                         'echo "rc=${PIPESTATUS[0]}" >&2', "_", str(ckpt)],
                          capture_output=True, text=True, env=clean_env(), timeout=120)
    assert proc.stdout.count("\n") == 1
    assert proc.stderr.strip().splitlines()[-1] in ("rc=141", "rc=0"), proc.stderr  # 0: it all fit the pipe
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# -q and pipes


def test_quiet_success_prints_nothing(ckpt, tmp_path):
    """The cron line of docs/GC_TMP.md logs nothing when all is well (nothing to remove, nothing
    found); -q keeps other commands' results on stdout (tests/test_cli_screens.py)."""
    for args in (["gc-tmp", "-q", tmp_path], ["gc-tmp", "-q", "--check", tmp_path]):
        r = run_ckptctl(*args)
        assert r.returncode == 0 and r.stdout == "" and r.stderr == "", (args, r.stdout, r.stderr)


def test_quiet_still_shows_what_failed(tmp_path):
    leak = tmp_path / "_tmp_ckpt.18ecc906440da92e-4404158d"
    leak.mkdir()
    (leak / "owner.json").write_text(json.dumps({"tool": "ckptctl", "pid": 1 << 22, "host": "node-9.invalid"}))
    r = run_ckptctl("gc-tmp", "-q", "--check", "--older-than", "0s", "--min-age", "0", tmp_path)
    assert r.returncode == 1 and leak.name in r.stdout and "would remove" in r.stdout


def _trailing(text: str) -> list[str]:
    return [line for line in text.splitlines() if line != line.rstrip()]


def test_tables_in_a_pipe_carry_no_trailing_whitespace(ckpt, tmp_path):
    leak = tmp_path / "gc" / "_tmp_ckpt.18ecc906440da92e-4404158d"
    leak.mkdir(parents=True)
    for args in (["inspect", ckpt, "--tensors"], ["export", ckpt, tmp_path / "out"],
                 ["gc-tmp", "--dry-run", tmp_path / "gc"]):
        r = run_ckptctl(*args)
        assert r.returncode == 0 and r.stdout.count("\n") > 2, r.stderr
        assert _trailing(r.stdout) == [], args
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    r = run_ckptctl("verify", ckpt)
    assert r.returncode == 1 and "layout.shard_missing" in r.stdout and _trailing(r.stdout) == []


# ---------------------------------------------------------------------------------------------
# a file that vanished mid-operation: exit 3 (I/O), not 2 (usage)


def test_a_source_file_that_vanishes_mid_export_exits_3(ckpt, tmp_path):
    proc = popen_ckptctl("export", ckpt, tmp_path / "out", "--json", env={"CKPTCTL_STOP_AT": "stage-created"})
    wait_stopped(proc.pid)
    (ckpt / "model-00003-of-00003.safetensors").unlink()  # another process removes it meanwhile
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    doc = _one_document(out)
    assert doc["error"]["code"] == "operational" and "no such file or directory" in doc["error"]["message"]
    assert "model-00003-of-00003.safetensors" in doc["error"]["message"]
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_missing_input_is_still_a_usage_error(tmp_path):
    r = run_ckptctl("export", tmp_path / "absent", tmp_path / "out", "--json")
    assert r.returncode == 2 and _one_document(r.stdout)["error"]["code"] == "input"


# ---------------------------------------------------------------------------------------------
# destination names


@pytest.mark.parametrize("name,words", [
    ("a\nb", "holds a control character"), ("tab\there", "holds a control character"),
    ("x" * 255, "255 bytes long"), ("x" * 224, "224 bytes long"),
])
def test_a_destination_name_without_room_for_its_staging_directory_is_refused_up_front(ckpt, tmp_path, name,
                                                                                      words):
    r = run_ckptctl("export", ckpt, tmp_path / name, "--json")
    assert r.returncode == 2, r.stderr
    err = _one_document(r.stdout)["error"]
    assert err["code"] == "usage" and words in err["message"] and "\n" not in err["message"]
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), r.stderr
    assert "_tmp_" not in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_the_longest_name_that_fits_is_written(ckpt, tmp_path):
    r = run_ckptctl("export", ckpt, tmp_path / ("x" * 223))
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------
# a full disk reads well


def test_no_space_left_reads_well(ckpt, tmp_path):
    r = run_ckptctl("export", ckpt, tmp_path / "out", "--json", env={"CKPTCTL_FAIL_AT": "write-data:ENOSPC"})
    assert r.returncode == 3, r.stderr
    msg = _one_document(r.stdout)["error"]["message"]
    assert msg == "cannot write model.safetensors: no space left on the device", msg
    assert " at " not in msg and msg.count("cannot write") == 1, msg
