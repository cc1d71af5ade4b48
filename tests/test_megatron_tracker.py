"""Megatron's tracker file (``latest_checkpointed_iteration.txt``) holds ASCII digits or
``release``: anything else (a Unicode digit that ``str.isdigit`` takes and ``int`` refuses, a
full-width digit, Arabic-Indic digits) is the one-line input error naming the tracker, in export
and inspect alike, never a traceback. No Megatron needed: the tracker is read before any tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import invoke


def _root(tmp: Path, tracker: str) -> Path:
    root = tmp / "run"
    (root / "iter_0000007").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(tracker, encoding="utf-8")
    return root


@pytest.mark.parametrize("tracker", ["\u00b2", "7\u00b2", "\uff17", "\u0667", "\u09ed\n"])
@pytest.mark.parametrize("command", ["export", "inspect"])
def test_a_tracker_of_non_ascii_digits_is_the_input_error(tmp_path, tracker, command):
    root = _root(tmp_path, tracker)
    args = [root, tmp_path / "out"] if command == "export" else [root]
    r = invoke(command, *args, "--json")
    assert r.exit_code == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert "latest_checkpointed_iteration.txt names iteration" in doc["error"]["message"]
    assert "present: iter_0000007" in doc["error"]["hint"]
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


def test_an_iteration_folder_of_non_ascii_digits_is_not_an_iteration(tmp_path):
    """``iter_`` then seven Arabic-Indic digits is no folder Megatron writes: not listed as present."""
    from ckptctl.sources.megatron.locate import find_megatron

    root = _root(tmp_path, "3")
    (root / "iter_\u0660\u0660\u0660\u0660\u0660\u0660\u0663").mkdir()
    with pytest.raises(Exception) as exc:
        find_megatron(root)
    assert "present: iter_0000007" in exc.value.hint and "\u0663" not in exc.value.hint
