"""``ckptctl.gcpause``: the collector paused for a call, and restored as the caller had it."""

from __future__ import annotations

import gc
from pathlib import Path

from ckptctl import gcpause

REPO = Path(__file__).resolve().parents[1]


def test_paused_restores_the_collector_and_never_enables_one_the_caller_disabled() -> None:
    assert gc.isenabled()
    with gcpause.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _died_paused(monkeypatch, module, name: str) -> list[bool]:
    """Wrap ``module.name`` (a function whose first argument is a command's metadata: export's
    inputs) to record, when that object is freed, whether the collector was paused then."""
    import weakref

    seen: list[bool] = []
    real = getattr(module, name)

    def wrapped(first, *args, **kwargs):
        weakref.finalize(first, lambda: seen.append(not gc.isenabled()))
        return real(first, *args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return seen


def test_an_exports_metadata_is_freed_before_the_collector_resumes(tmp_path: Path, monkeypatch) -> None:
    """Resumed with a large export's records alive, the collector's first pass traversed them
    all (27 ms of a 91,991-tensor export): the export frees them inside the pause, for the API
    and for the follower."""
    from ckptctl import api
    from ckptctl.follow.export import export_save
    from ckptctl.write.options import ExportOptions
    from tests.support import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "src")
    seen = _died_paused(monkeypatch, api, "write_inputs")
    api.export(src, tmp_path / "out")
    export_save(src, tmp_path / "followed", ExportOptions(), key=None, only=None, check=lambda _: None)
    assert seen == [True, True] and gc.isenabled()


ENTRY_PROBE = r"""
import gc, json, os, sys
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
real_exit = os._exit

def report(code):
    sys.stdout.write(json.dumps({"code": code, "collections": len(runs), "frozen": gc.get_freeze_count(),
                                 "enabled": gc.isenabled()}) + "\n")
    sys.stdout.flush()
    real_exit(code)

os._exit = report
sys.argv = ["ckptctl", "--version"]
import ckptctl.__main__ as entry
entry.main()
"""


def test_the_entry_point_imports_the_cli_uncollected_and_freezes_what_it_made() -> None:
    """``python -m ckptctl`` and the console script import Typer and the CLI with the collector
    paused (about 25 collections, 3.5 ms, otherwise) and freeze those objects; the command runs
    with the collector on."""
    import json
    import subprocess
    import sys

    from tests.support.cli import clean_env

    r = subprocess.run([sys.executable, "-c", ENTRY_PROBE], capture_output=True, text=True, env=clean_env(),
                       timeout=120)
    doc = json.loads(r.stdout.splitlines()[-1])
    assert doc["code"] == 0 and doc["enabled"] is True, r.stderr
    # collected as they were made, the imports' objects cost about 25 collections; --version itself
    # makes a few thousand objects after the freeze (4 collections with Typer 0.28)
    assert doc["frozen"] > 10_000 and doc["collections"] < 10, doc
