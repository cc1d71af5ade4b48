"""CLI conventions (DESIGN.md section 4), checked on real processes: exit codes, stdout for data
only, one JSON document even on failure, one-line errors with hints, CKPTCTL_DEBUG tracebacks.
That --help, completion, inspect, verify and gc-tmp never import torch is in test_layering.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckptctl._version import __version__
from tests.support import write_tiny_checkpoint


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("conv") / "ckpt")


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


def test_bad_only_value_is_usage_error(run_cli, st_dir: Path) -> None:
    rc, out, err = run_cli("inspect", st_dir, "--only", "bogus")
    assert rc == 2 and out == ""
    assert ("error: invalid value for --only: 'bogus' is not one of 'megatron', 'zero', 'dcp-hf', 'safetensors', "
            "'pytorch', 'peft', 'dcp', 'index', 'single'\nhint: ckptctl inspect -h\n") == err


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


@pytest.mark.parametrize("args", [["--help"], ["-h"], [], ["--version"], ["nosuch"], ["--bogus"], ["--", "x"]])
def test_a_command_line_naming_no_command_answers_as_the_full_app(args: list[str]) -> None:
    """The app the entry point builds for a command line that names no command lists the
    commands only (no option of any command built); what it answers is the full app's, to the
    byte and exit code."""
    from typer.testing import CliRunner

    from ckptctl.cli import app_for, full_app

    listed = CliRunner().invoke(app_for(args), args, prog_name="ckptctl")
    full = CliRunner().invoke(full_app(), args, prog_name="ckptctl")
    assert (listed.exit_code, listed.stdout, listed.stderr) == (full.exit_code, full.stdout, full.stderr)


def test_the_listed_only_app_lists_every_command_and_builds_no_option() -> None:
    import typer.main

    from ckptctl.cli import COMMANDS, app_for, build

    listed = typer.main.get_command(build(listed_only=True))
    full = typer.main.get_command(build())
    assert list(listed.commands) == list(full.commands) == list(COMMANDS)
    for name, command in listed.commands.items():
        assert command.params == [] and command.short_help == full.commands[name].short_help
        assert full.commands[name].params, name
    for args in (["--help"], [], ["-h", "--version"]):  # what the entry point builds for them
        assert all(not c.params for c in typer.main.get_command(app_for(args)).commands.values())
    assert typer.main.get_command(app_for(["verify", "--help"])).commands["verify"].params


# ------------------------------------------------------------------------------------------
# Usage errors Typer finds, in the house form (the real entry point: ckptctl.cli.main)


@pytest.mark.parametrize("args,first", [
    (["export"], "error: missing argument SRC"),
    (["export", "a"], "error: missing argument DST"),
    (["inspect"], "error: missing argument PATH"),
    (["verify", "--fail-on", "never", "x"], "error: invalid value for --fail-on: 'never' is not one of"),
    (["export", "a", "b", "--dtype"], "error: option --dtype requires an argument"),
    (["gc-tmp", "--dry-runn", "x"], "error: no such option: --dry-runn; did you mean --dry-run?"),
])
def test_usage_errors_in_the_house_form(run_cli, args: list[str], first: str) -> None:
    rc, out, err = run_cli(*args)
    assert rc == 2 and out == ""
    assert_one_line_error(err)
    line, hint = err.strip().splitlines()
    assert line.startswith(first), err
    command = next(a for a in args if not a.startswith("-"))
    assert hint == f"hint: ckptctl {command} -h"
    rc, out, err = run_cli(args[0], "--json", *args[1:])
    doc = json.loads(out)
    assert rc == 2 and doc["ok"] is False and doc["command"] == command
    assert doc["error"]["message"] == line[len("error: "):] and doc["error"]["hint"] == f"ckptctl {command} -h"


# ------------------------------------------------------------------------------------------
# README's commands table and each command's help agree; help has examples and whole summaries


def _readme_commands() -> dict[str, list[str]]:
    from tests.support import REPO

    text = (REPO / "README.md").read_text()
    table = text[text.index("## Commands"):].split("\n\n")[1]
    rows = re.findall(r"^\| `ckptctl ([a-z-]+)((?: [A-Z.]+)*)` \|", table, re.MULTILINE)
    return {name: args.split() for name, args in rows}


def test_readme_commands_table_agrees_with_help(run_cli) -> None:
    from ckptctl.cli import COMMANDS

    readme = _readme_commands()
    assert sorted(readme) == sorted(COMMANDS)
    rc, top, err = run_cli("--help")
    for name, args in readme.items():
        rc, out, err = run_cli(name, "--help")
        assert rc == 0, err
        usage = out.splitlines()[0]
        assert usage.startswith(f"Usage: ckptctl {name} [OPTIONS]"), usage
        shown = [re.sub(r"[{}\[\]]", "", a) for a in usage.split()[4:]]
        assert shown == args, (name, usage, args)
        assert "\n  Examples:\n" in out and f"\n    ckptctl {name}" in out, name
        assert "[default: 0]" not in out and "<str>" not in out, name
        assert "..." not in top.split("Commands:")[1].replace("ROOT...", "")  # whole summaries


def test_examples_in_help_parse(run_cli, cli) -> None:
    """Every example a help shows is a command line its command accepts (--help appended: Typer
    parses the options and arguments before it prints the help)."""
    import shlex

    from ckptctl.cli import COMMANDS

    for name in COMMANDS:
        rc, out, err = run_cli(name, "--help")
        block = out.split("\n  Examples:\n\n", 1)[1].split("\n\n", 1)[0]
        for line in block.splitlines():
            words = shlex.split(line.split("#", 1)[0].split("|", 1)[0].split(">", 1)[0])
            assert words[:2] == ["ckptctl", name], line
            res = cli(*words[1:], "--help")  # Typer parses every option before --help prints
            assert res.exit_code == 0 and "Usage:" in res.output, (line, res.output)
