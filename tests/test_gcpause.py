"""``ckptctl.gcpause``: the collector paused for a call, and what the CLI keeps until its process
ends (``keep_until_exit``): nothing outside the CLI, the export's records inside it."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
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


def test_nothing_is_kept_unless_asked_and_stopping_drops_it() -> None:
    obj = object()
    gcpause.keep_until_exit(obj)
    assert gcpause._until_exit is None
    gcpause.hold_until_exit(True)
    try:
        gcpause.keep_until_exit(obj)
        assert gcpause._until_exit == [obj]
    finally:
        gcpause.hold_until_exit(False)
    assert gcpause._until_exit is None


def test_the_cli_keeps_an_exports_job_until_its_process_ends(tmp_path: Path) -> None:
    """An export through ``cli.main`` hands its job to the keeper (freed by the process's end);
    the library's export keeps nothing."""
    from safetensors.numpy import save_file
    import numpy as np

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(src / "model.safetensors"), metadata={"format": "pt"})
    code = textwrap.dedent(f"""
        import sys, atexit
        from ckptctl import gcpause, api
        api.export({str(src)!r}, {str(tmp_path / 'lib')!r})
        assert gcpause._until_exit is None
        def seen():
            kept = gcpause._until_exit or []
            print("kept", [type(o).__name__ for o in kept], flush=True)
        atexit.register(seen)
        sys.argv = ["ckptctl", "export", {str(src)!r}, {str(tmp_path / 'cli')!r}, "-q"]
        from ckptctl.cli import main
        main()
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "kept ['ExportJob']" in p.stdout
    assert (tmp_path / "cli" / "model.safetensors").is_file()
