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


# ---------------------------------------------------------------------------------------------
# Each shell for real: the committed script loaded into the shell, completion through the shell's
# own machinery (bash and zsh: an interactive shell on a pty, a TAB pressed; fish: `complete -C`).


def _pty_shell(argv: list[str], setup: str, partial: str) -> str:
    """The command line ``partial`` after a TAB, as the shell completed it: typed into an
    interactive ``argv`` on a pty after ``setup``; Ctrl-A and ``echo RESULT: `` make the shell print
    the completed line (readline and zle handle the keys in order: no waiting on time)."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True, start_new_session=True,
                            env=clean_env(TERM="dumb", PS1="$ ", HISTFILE=os.devnull))
    os.close(slave)
    os.write(master, f"{setup}\n{partial}\t\x01echo RESULT: \nexit\n".encode())
    chunks: list[bytes] = []
    while select.select([master], [], [], 120)[0]:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the shell exited and closed the pty
            break
        if not data:
            break
        chunks.append(data)
    proc.kill() if proc.poll() is None else None
    proc.wait(timeout=60)
    os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", b"".join(chunks).decode("utf-8", "replace")).replace("\r", "")
    found = re.findall(r"^RESULT: (.*)$", text, re.MULTILINE)
    assert found, text[-2000:]
    return found[-1].strip()


SHELLS = {
    "bash": (["bash", "--norc", "--noprofile", "-i"], f"source {COMPLETIONS / 'ckptctl.bash'}"),
    "zsh": (["zsh", "-f", "-i"], f"bindkey -e; autoload -U compinit; compinit -u -D; source {COMPLETIONS / '_ckptctl'}"),
}


def _shell(name: str) -> tuple[list[str], str]:
    if shutil.which(name) is None:
        pytest.skip(f"{name} is not installed")
    return SHELLS[name]


@pytest.mark.parametrize("shell", sorted(SHELLS))
@pytest.mark.parametrize("partial,completed", [
    ("ckptctl export a b --dtype bf", "ckptctl export a b --dtype bf16"),
    ("ckptctl resave a --dtype fp3", "ckptctl resave a --dtype fp32"),
    ("ckptctl inspect a --only meg", "ckptctl inspect a --only megatron"),
    ("ckptctl export a b --only zer", "ckptctl export a b --only zero"),
    ("ckptctl export a b --names megat", "ckptctl export a b --names megatron"),
    ("ckptctl inspect a --only dcp-", "ckptctl inspect a --only dcp-hf"),
    ("ckptctl gc-tmp a --preset trai", "ckptctl gc-tmp a --preset trainer-tmp"),
    ("ckptctl verify --fail-on warn", "ckptctl verify --fail-on warning"),
])
def test_values_complete_in_the_shell(shell: str, partial: str, completed: str) -> None:
    argv, setup = _shell(shell)
    assert _pty_shell(argv, setup, partial) == completed


@pytest.mark.parametrize("shell", sorted(SHELLS))
@pytest.mark.parametrize("command", ["export", "resave", "inspect", "verify"])
def test_paths_complete_in_the_shell(shell: str, command: str, tmp_path: Path) -> None:
    argv, setup = _shell(shell)
    (tmp_path / "step_1000-checkpoint").mkdir()
    got = _pty_shell(argv, setup, f"ckptctl {command} {tmp_path}/step_1")
    assert got.rstrip("/") == f"ckptctl {command} {tmp_path}/step_1000-checkpoint"
    if command == "export":  # DST too
        got = _pty_shell(argv, setup, f"ckptctl export x {tmp_path}/step_1")
        assert got.rstrip("/") == f"ckptctl export x {tmp_path}/step_1000-checkpoint"


def _fish(line: str) -> list[str]:
    """What fish offers for ``line`` (its own machinery: ``complete -C``), the script sourced."""
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed")
    proc = subprocess.run(["fish", "--no-config", "-c", f"source {COMPLETIONS / 'ckptctl.fish'}; complete -C $argv[1]",
                           line], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [row.split("\t")[0] for row in proc.stdout.splitlines()]


def test_fish_completes_values_and_paths(tmp_path: Path) -> None:
    assert sorted(_fish("ckptctl export a b --dtype ")) == ["bf16", "fp16", "fp32", "keep"]
    assert {"megatron", "zero", "dcp-hf", "safetensors", "index", "single"} <= set(_fish("ckptctl inspect a --only "))
    assert _fish("ckptctl gc-tmp a --preset inc") == ["incomplete"]
    (tmp_path / "step_1000-checkpoint").mkdir()
    for line in (f"ckptctl export {tmp_path}/step_1", f"ckptctl export x {tmp_path}/step_1",
                 f"ckptctl inspect {tmp_path}/step_1", f"ckptctl verify {tmp_path}/step_1"):
        assert _fish(line) == [f"{tmp_path}/step_1000-checkpoint/"], line
