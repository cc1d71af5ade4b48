"""CLI conventions (DESIGN.md section 4), checked on real processes: exit codes, stdout for data
only, one JSON document even on failure, one-line errors with hints, CKPTCTL_DEBUG tracebacks,
and no torch import for --help, shell completion and inspecting safetensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptctl._version import __version__


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("conv") / "ckpt"
    d.mkdir()
    save_file({"model.embed.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)},
              d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    return d


@pytest.fixture(scope="module")
def corrupt_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corrupt") / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(
        b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1000\n")
    return d


def assert_one_line_error(stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 2, stderr
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert "Traceback" not in stderr


# ------------------------------------------------------------------------------------------
# Exit codes, streams, JSON


def test_missing_path(run_cli, tmp_path: Path) -> None:
    rc, out, err = run_cli("inspect", tmp_path / "absent")
    assert rc == 2
    assert out == ""
    assert_one_line_error(err)
    assert "absent" in err


def test_missing_path_json(run_cli, tmp_path: Path) -> None:
    rc, out, err = run_cli("inspect", tmp_path / "absent", "--json")
    assert rc == 2
    doc = json.loads(out)  # exactly one document: json.loads refuses anything after it
    assert (doc["schema_version"], doc["command"], doc["ok"]) == (1, "inspect", False)
    assert doc["tool_version"] == __version__
    assert doc["error"]["code"] == "input" and doc["error"]["exit_code"] == 2
    assert doc["error"]["message"] and doc["error"]["hint"]
    assert_one_line_error(err)


def test_corrupt_file(run_cli, corrupt_dir: Path) -> None:
    rc, out, err = run_cli("inspect", corrupt_dir)
    assert rc == 2 and out == ""
    assert_one_line_error(err)
    assert "header.lfs_pointer" in err and "git lfs pull" in err


def test_corrupt_file_json(cli, corrupt_dir: Path) -> None:
    res = cli("inspect", corrupt_dir, "--json")
    assert res.exit_code == 2
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and "header.lfs_pointer" in doc["error"]["message"]
    assert res.stderr.startswith("error: ")


def test_truncated_shard(cli, st_dir: Path, tmp_path: Path) -> None:
    blob = (st_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(blob[:-10])
    res = cli("inspect", tmp_path)
    assert res.exit_code == 2 and res.stdout == ""
    assert "header.truncated" in res.stderr


def test_debug_shows_traceback(run_cli, tmp_path: Path) -> None:
    rc, out, err = run_cli("inspect", tmp_path / "absent", env={"CKPTCTL_DEBUG": "1"})
    assert rc == 2 and out == ""
    assert "Traceback (most recent call last)" in err
    assert "InputError" in err
    assert "error: " in err and "hint: " in err


def test_success_streams(run_cli, st_dir: Path) -> None:
    rc, out, err = run_cli("inspect", st_dir, "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    assert doc["ok"] is True and doc["parameters"] == 36
    rc, out, err = run_cli("inspect", st_dir)
    assert rc == 0 and err == "" and "36" in out


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "x", "--no-such-flag"], []])
def test_usage_errors_exit_2(cli, args: list[str]) -> None:
    res = cli(*args)
    assert res.exit_code == 2
    assert res.stdout == ""  # help and usage go to stderr: stdout is for data


def test_bad_only_value_is_usage_error(cli, st_dir: Path) -> None:
    res = cli("inspect", st_dir, "--only", "bogus")
    assert res.exit_code == 2 and res.stdout == ""
    assert "--only must be one of safetensors, pytorch, peft, dcp" in res.stderr


def test_only_family_absent(cli, st_dir: Path) -> None:
    res = cli("inspect", st_dir, "--only", "pytorch", "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout)["ok"] is False


def test_version_and_help(cli) -> None:
    res = cli("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"ckptctl {__version__}"
    res = cli("--help")
    assert res.exit_code == 0 and "inspect" in res.stdout
    res = cli("-h")
    assert res.exit_code == 0 and "inspect" in res.stdout


# ------------------------------------------------------------------------------------------
# No torch where it is not needed (a real interpreter, so nothing is imported beforehand)

PROBE = r"""
import json, sys
sys.argv = ["ckptctl", *json.loads(sys.argv[1])]
from ckptctl.cli import main
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "numpy"))
sys.stderr.write("\nPROBE " + json.dumps({"exit": code, "heavy": heavy}) + "\n")
"""


def probe(args: list[str], env: dict[str, str] | None = None) -> tuple[dict, str, str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("_CKPTCTL_COMPLETE")}
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True,
                          env=full_env, timeout=120)
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE "):]), proc.stdout, proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["inspect", "--help"], ["--version"]])
def test_help_does_not_import_torch(args: list[str]) -> None:
    result, out, _ = probe(args)
    assert result["exit"] in (0, None) and out
    assert [m for m in result["heavy"] if m.startswith("torch")] == []


def test_completion_does_not_import_torch() -> None:
    result, out, _ = probe([], env={"_CKPTCTL_COMPLETE": "complete_bash", "COMP_WORDS": "ckptctl in",
                                    "COMP_CWORD": "1"})
    assert "inspect" in out.split()
    assert [m for m in result["heavy"] if m.startswith("torch")] == []


def test_inspect_safetensors_does_not_import_torch(st_dir: Path) -> None:
    result, out, _ = probe(["inspect", str(st_dir), "--json", "--tensors"])
    assert result["exit"] in (0, None)
    assert json.loads(out)["parameters"] == 36
    assert result["heavy"] == []
    result, out, _ = probe(["inspect", str(st_dir / "model.safetensors"), "--tensors"])
    assert "model.embed.weight" in out and result["heavy"] == []


def test_probe_sees_torch_when_it_is_needed(tmp_path: Path) -> None:
    """The probe is not blind: inspecting a pickle must import torch."""
    torch.save({"w": torch.zeros(3)}, tmp_path / "pytorch_model.bin")
    result, out, _ = probe(["inspect", str(tmp_path), "--json"])
    assert json.loads(out)["parameters"] == 3
    assert "torch" in result["heavy"]
