"""Generic fixtures only; the helpers behind them live in ``tests.support``, topic-specific
fixtures in the test module that uses them."""

from __future__ import annotations

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
