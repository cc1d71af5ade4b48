"""The operator's screens (issue 46), on real processes: -q keeps each command's result on stdout
with an empty stderr, verify's findings are one grep-able line each (whole codes at 80 and 120
columns in a real pty), resave --dtype keeps the shard layout and says when it changes."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
from pathlib import Path

import pytest

from tests.support import write_tiny_checkpoint
from tests.support.builders import write_config, write_sharded
from tests.support.cli import CKPTCTL, clean_env, run_ckptctl

SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def _three_shards(d: Path) -> Path:
    import torch

    write_sharded(d, {f"model.layers.{i}.weight": torch.randn(16, 16) for i in range(6)}, per_shard=2)
    write_config(d, architectures=["LlamaForCausalLM"])
    return d


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """Three shards: one truncated, the index naming a tensor nobody holds and one in the wrong shard."""
    d = _three_shards(tmp_path / "damaged-checkpoint")
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.layers.9.weight"] = SHARDS[1]
    doc["weight_map"]["model.layers.0.weight"] = SHARDS[2]
    index.write_text(json.dumps(doc))
    blob = (d / SHARDS[1]).read_bytes()
    (d / SHARDS[1]).write_bytes(blob[:-100])
    return d


CODES = ("header.truncated", "index.tensor_missing", "index.wrong_shard")


# ---------------------------------------------------------------------------------------------
# -q: the result on stdout, nothing on stderr


def _quiet_run(command: str, tmp_path: Path, damaged: Path):
    """``command -q`` on a real checkpoint (``damaged`` for verify, a dead writer's leftover for
    gc-tmp) and what its result must show on stdout."""
    src = _three_shards(tmp_path / "src")
    if command == "export":
        return run_ckptctl("export", "-q", src, tmp_path / "out", "--no-fsync"), 0, ["model.safetensors", "written"]
    if command == "resave":
        return run_ckptctl("resave", "-q", src, "--dtype", "bf16", "--no-fsync"), 0, [*SHARDS, "6 tensors converted"]
    if command == "inspect":
        return run_ckptctl("inspect", "-q", src), 0, ["parameters", SHARDS[0]]
    if command == "verify":
        return run_ckptctl("verify", "-q", "--static", damaged), 1, [*CODES, "    hint: "]
    if command == "env":
        return run_ckptctl("env", "-q"), 0, ["working directory: ", "torch "]
    leak = tmp_path / "gc" / "_tmp_ckpt.18ecc906440da92e-4404158d"
    leak.mkdir(parents=True)
    (leak / "owner.json").write_text(json.dumps({"tool": "ckptctl", "pid": 1 << 22, "host": "node-9.invalid"}))
    return run_ckptctl("gc-tmp", "-q", "--older-than", "0s", "--min-age", "0", tmp_path / "gc"), 0, \
        [leak.name, "removed 1"]


@pytest.mark.parametrize("command", ["export", "resave", "inspect", "verify", "gc-tmp", "env"])
def test_quiet_keeps_the_result_on_stdout(command: str, tmp_path: Path, damaged: Path) -> None:
    from ckptctl.cli import COMMANDS

    assert command in COMMANDS
    r, code, shown = _quiet_run(command, tmp_path, damaged)
    assert r.returncode == code and r.stderr == "", r.stderr
    assert all(text in r.stdout for text in shown), r.stdout


def test_every_command_has_a_quiet_test() -> None:
    from ckptctl.cli import COMMANDS

    marks = test_quiet_keeps_the_result_on_stdout.pytestmark  # type: ignore[attr-defined]
    assert sorted(marks[0].args[1]) == sorted(COMMANDS)


# ---------------------------------------------------------------------------------------------
# verify's findings


def test_findings_are_one_line_each_with_an_indented_hint(damaged: Path) -> None:
    r = run_ckptctl("verify", "--static", damaged)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    found = [line for line in lines if not line.startswith("    ")]
    assert len(found) == 3, r.stdout
    for line, code in zip(found, CODES):
        path, _severity, shown = re.match(r"^(.*?): (error|warning) (\S+): ", line).groups()
        assert shown == code and path.startswith(str(damaged))
        message = line.split(f"{code}: ", 1)[1]
        assert str(damaged) not in message  # the message does not repeat the path
    assert all(line.startswith("    hint: ") for line in lines if line.startswith("    "))
    assert sum(line.startswith("    hint: ") for line in lines) == 3
    assert "\x1b[" not in r.stdout  # a pipe: no colour
    assert "┃" not in r.stdout  # the table only with -v
    r = run_ckptctl("verify", "--static", "-v", damaged)
    assert "┃" in r.stdout and "config.missing" not in r.stdout  # a config is there: no note of its absence


def _pty_run(args: list[str], columns: int, env: dict[str, str] | None = None) -> str:
    """``ckptctl ARGS`` with stdout and stderr on a pty of ``columns`` columns; what it printed."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    full_env = clean_env({"COLUMNS": str(columns), "TERM": "xterm-256color"})
    full_env.pop("NO_COLOR", None)
    full_env.update(env or {})
    proc = subprocess.Popen([*CKPTCTL, *args], stdin=slave, stdout=slave, stderr=slave, env=full_env, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.parametrize("columns", [80, 120])
def test_finding_codes_are_whole_on_a_terminal(damaged: Path, columns: int) -> None:
    text = _pty_run(["verify", "--static", str(damaged)], columns, env={"NO_COLOR": "1"})
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text).replace("\r", "")
    for code in CODES:
        assert any(code in line for line in plain.split("\n")), plain
    findings = [line for line in plain.split("\n") if not line.startswith(("checks of", "verify:"))]
    assert all(len(line) <= columns for line in findings), plain  # rich wrapped them between words
    assert "\x1b[1;31m" not in text  # NO_COLOR
    coloured = _pty_run(["verify", "--static", str(damaged)], columns, env={"FORCE_COLOR": "1"})
    assert "error" in coloured and "\x1b[" in coloured


# ---------------------------------------------------------------------------------------------
# resave --dtype keeps the layout


def test_resave_dtype_keeps_the_shards_and_says_when_a_size_changes_them(tmp_path: Path) -> None:
    d = _three_shards(tmp_path / "ckpt")
    r = run_ckptctl("resave", d, "--dtype", "bf16", "--no-fsync")
    assert r.returncode == 0, r.stderr
    assert sorted(n for n in os.listdir(d) if n.endswith(".safetensors")) == SHARDS
    assert "layout changed" not in r.stderr
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.0.weight"] == SHARDS[0]
    assert index["weight_map"]["model.layers.5.weight"] == SHARDS[2]
    r = run_ckptctl("resave", d, "--dtype", "fp32", "--max-shard-size", "1GB", "--no-fsync")
    assert r.returncode == 0, r.stderr
    assert sorted(n for n in os.listdir(d) if n.endswith(".safetensors")) == ["model.safetensors"]
    assert "layout changed: 3 shards -> 1 shard" in r.stderr


def test_tiny_checkpoint_quiet_inspect_json_is_unchanged(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path / "tiny")
    r = run_ckptctl("inspect", "-q", "--json", d)
    assert r.returncode == 0 and r.stderr == "" and json.loads(r.stdout)["parameters"] == 36


# ---------------------------------------------------------------------------------------------
# ckptctl env


def test_env_reports_versions_switches_and_the_filesystem(tmp_path: Path) -> None:
    from importlib import metadata

    r = run_ckptctl("env", "--json", cwd=tmp_path, env={"CKPTCTL_FAST_PIECES": "0", "CKPTCTL_DEBUG": "1"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert (doc["command"], doc["ok"]) == ("env", True)
    assert doc["packages"]["torch"] == metadata.version("torch")
    assert doc["packages"]["typer"] == metadata.version("typer")
    assert doc["fast_paths"]["pieces"]["on"] is False and doc["fast_paths"]["metadata"]["on"] is True
    assert doc["variables"]["CKPTCTL_DEBUG"] == "1" and doc["variables"]["CKPTCTL_KILL_AT"] is None
    assert {"CKPTCTL_FAST_METADATA", "CKPTCTL_FAIL_AT"} <= set(doc["variables"])
    fs = doc["cwd"]
    assert fs["path"] == os.path.realpath(tmp_path) and fs["type"] and fs["free_bytes"] > 0
    assert fs["reflink"] in (True, False)
    assert os.listdir(tmp_path) == []  # the clone probe left nothing
    text = run_ckptctl("env", cwd=tmp_path)
    assert text.returncode == 0 and f"torch {metadata.version('torch')}" in text.stdout
    assert f"working directory: {os.path.realpath(tmp_path)} on {fs['type']}" in text.stdout


def test_env_never_imports_torch() -> None:
    import sys

    # the modules listed by an exit handler: it runs however the process ends (cli.leave)
    probe = ("import atexit, sys, runpy; sys.argv = ['ckptctl', 'env', '--json']\n"
             "atexit.register(lambda: print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules),"
             " file=sys.stderr))\n"
             "runpy.run_module('ckptctl', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "[]", proc.stderr
