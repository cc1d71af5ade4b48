"""Shell completion: the committed scripts are what the CLI generates today, bash can source
them, and live completion (Typer's ``_CKPTCTL_COMPLETE`` protocol) completes commands and options."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

COMPLETIONS = REPO / "completions"
SCRIPTS = ("ckptctl.bash", "_ckptctl", "ckptctl.fish")
BIN = Path(sys.executable).parent  # the venv's bin, where the `ckptctl` console script lives


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("_CKPTCTL_COMPLETE", "COMP_", "_TYPER_COMPLETE"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def complete(words: str, cword: int) -> list[str]:
    """What bash completion gets from the real ``ckptctl`` entry point."""
    proc = subprocess.run(["ckptctl"], env=clean_env(_CKPTCTL_COMPLETE="complete_bash", COMP_WORDS=words,
                                                     COMP_CWORD=str(cword)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def registered_commands() -> set[str]:
    """Command names from ``ckptctl --help`` (the public view of what is registered)."""
    proc = subprocess.run(["ckptctl", "--help"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout.split("Commands:", 1)[1]
    return set(re.findall(r"^ {2}([a-z][a-z0-9-]*)\b", section, re.MULTILINE))


def test_committed_scripts_match_generator(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(COMPLETIONS / "generate.py"), str(tmp_path)], env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SCRIPTS)
    for name in SCRIPTS:
        fresh = (tmp_path / name).read_bytes()
        committed = (COMPLETIONS / name).read_bytes()
        assert fresh == committed, f"completions/{name} is stale: run `python completions/generate.py`"


def test_scripts_name_the_program() -> None:
    for name in SCRIPTS:
        text = (COMPLETIONS / name).read_text()
        assert "_CKPTCTL_COMPLETE=complete_" in text and "ckptctl" in text


def test_live_completion_of_inspect() -> None:
    assert complete("ckptctl in", 1) == ["inspect"]
    assert "--json" in complete("ckptctl inspect --j", 2)
    assert {"--tensors", "--filter", "--only"} <= set(complete("ckptctl inspect --", 2))


def test_live_completion_lists_every_command() -> None:
    commands = registered_commands()
    assert "inspect" in commands
    assert set(complete("ckptctl ", 1)) == commands


def test_live_completion_of_verify() -> None:
    if "verify" not in registered_commands():
        pytest.skip("the verify command is not registered yet")
    assert complete("ckptctl ve", 1) == ["verify"]


def test_bash_sources_the_script_and_completes() -> None:
    script = COMPLETIONS / "ckptctl.bash"
    proc = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c",
         f'set -e; source "{script}"; complete -p ckptctl; '
         'COMP_WORDS=(ckptctl in); COMP_CWORD=1; _ckptctl_completion ckptctl; printf "<%s>\\n" "${COMPREPLY[@]}"'],
        env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0] == "complete -o default -F _ckptctl_completion ckptctl"
    assert lines[1:] == ["<inspect>"]


@pytest.mark.parametrize("shell,name", [("zsh", "_ckptctl"), ("fish", "ckptctl.fish")])
def test_other_shells_parse_the_script(shell: str, name: str) -> None:
    exe = shutil.which(shell)
    if exe is None:
        pytest.skip(f"{shell} is not installed")
    proc = subprocess.run([exe, "-n", str(COMPLETIONS / name)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
