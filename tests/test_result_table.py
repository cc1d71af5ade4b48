"""The result table without rich (issue 47, ``ckptctl/cli/_table.py``): off a terminal,
:func:`ruled` writes exactly what rich draws for the same table, or declines; a command's stdout is
the same with the fast path on and off."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from ckptctl.cli._table import rich_table, ruled
from tests.support import clean_env

ROOT = Path(__file__).resolve().parents[1]
FILES = (("file", "left"), ("size", "right"), ("tensors", "right"))


def _as_rich_draws_it(columns, rows) -> str:
    """What ``Output.print`` writes for a table off a terminal (see ``cli/_output.py``)."""
    page = Console(file=io.StringIO(), width=100_000, markup=False, highlight=False, soft_wrap=False,
                   color_system=None)
    page.print(rich_table(columns, rows))
    return "\n".join(line.rstrip() for line in page.file.getvalue().split("\n"))


@pytest.mark.parametrize("columns, rows", [
    (FILES, [("model.safetensors", "191.19 kB", "21"), ("config.json", "", "")]),
    (FILES, [("a", "1", "1")]),  # cells narrower than their headers
    (FILES, [("x" * 300, "9.99 GB", "1,000,000"), ("", "", "")]),  # a long name; an empty row
    ((("path", "left"), ("age", "right"), ("why", "left")), [("/tmp/_tmp_x.0123-ab", "3 h", "dead writer pid 7")]),
    ((("only", "right"),), [("in spaced",), ("tab-free",)]),
])
def test_ruled_is_what_rich_draws(columns, rows) -> None:
    assert ruled(columns, rows) == _as_rich_draws_it(columns, rows)


@pytest.mark.parametrize("rows", [
    [("modèle.safetensors", "1 kB", "1")],  # not ASCII: a character's width is rich's to say
    [("a\tb", "1 kB", "1")],  # a control character
    [],  # no row: rich's own drawing
    [("two", "cells")],  # a row of the wrong width
    [(" padded ", "1 kB", "1")],  # outer spaces: rich trims them
])
def test_ruled_declines_what_it_cannot_be_sure_of(rows) -> None:
    assert ruled(FILES, rows) is None


def test_an_export_prints_the_same_result_with_the_fast_path_on_and_off(tmp_path: Path) -> None:
    out = {}
    for fast in ("1", "0"):
        r = subprocess.run([sys.executable, "-m", "ckptctl", "export", str(ROOT / "examples" / "tiny-llama"),
                            str(tmp_path / f"out{fast}"), "-q"], capture_output=True, text=True, cwd=ROOT,
                           env=clean_env({"CKPTCTL_FAST_TABLE": fast, "PYTHONPATH": str(ROOT)}), timeout=300)
        assert r.returncode == 0, r.stderr
        out[fast] = r.stdout.replace(f"out{fast}", "OUT")
        out[fast] = "\n".join(line for line in out[fast].split("\n") if not line.startswith("published by"))
    assert "┃ file" in out["1"] and out["1"] == out["0"]
