"""Generic fixtures only; the helpers behind them live in ``tests.support``, topic-specific
fixtures in the test module that uses them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.support import invoke, run_cli_subprocess


@pytest.fixture
def run_cli() -> Callable[..., tuple[int, str, str]]:
    """``run_cli("inspect", path, "--json") -> (rc, stdout, stderr)`` in a real subprocess."""
    return run_cli_subprocess


@pytest.fixture
def cli() -> Callable[..., Any]:
    """In-process runner: ``cli("inspect", path).exit_code / .stdout / .stderr``."""
    return invoke


@pytest.fixture
def mount_tmpfs():
    """``mount_tmpfs(where, size="16m") -> where`` with a fresh tmpfs mounted there (skips the test
    where mounting is not permitted); unmounted after the test."""
    mounted: list[Path] = []

    def mount(where: Path, size: str = "16m") -> Path:
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(where)
        return where

    yield mount
    for m in reversed(mounted):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
