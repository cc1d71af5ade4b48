"""Generic fixtures only; topic-specific fixtures live in the test module that uses them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_cli_subprocess(*args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                       input: str | None = None, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``python -m ckptctl ARGS`` as a real process; returns (exit code, stdout, stderr)."""
    full_env = dict(os.environ)
    full_env.pop("CKPTCTL_DEBUG", None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "ckptctl", *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, input=input, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def run_cli() -> Callable[..., tuple[int, str, str]]:
    """``run_cli("inspect", path, "--json") -> (rc, stdout, stderr)`` in a real subprocess."""
    return run_cli_subprocess


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    """In-process runner: ``cli("inspect", path).exit_code / .stdout / .stderr``."""
    from ckptctl.cli import app

    monkeypatch.delenv("CKPTCTL_DEBUG", raising=False)
    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None):
        return runner.invoke(app, [str(a) for a in args], env=env, prog_name="ckptctl")

    return invoke
