"""What `ckptctl verify` pays before and after its checks (issue 16): a command line that names
a command imports that command's module alone; a plain verify imports neither the deep step nor
the manifest module (hashing threads, logging), nor rich's table when -q prints nothing; and the
garbage collector verify pauses is running again afterwards."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, clean_env, invoke, write_tiny_checkpoint

COMMAND_MODULES = {"ckptctl.cli.export_cmd", "ckptctl.cli.gc_cmd", "ckptctl.cli.inspect_cmd",
                   "ckptctl.cli.resave_cmd", "ckptctl.cli.verify_cmd"}
DEEP_ONLY = {"ckptctl.verify.deep", "ckptctl.threads", "ckptctl.manifest", "concurrent.futures"}


# the CLI's entry point with an exit hook that lists every module the process imported
LIST_MODULES = ("import atexit, json, sys\n"
                "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)) + '\\n'))\n"
                "sys.argv[0] = 'ckptctl'\n"
                "from ckptctl.cli import main\n"
                "main()\n")


def modules(args: list[object]) -> tuple[int, set[str]]:
    """``ckptctl ARGS`` in a fresh interpreter: its exit code and every module it imported."""
    proc = subprocess.run([sys.executable, "-c", LIST_MODULES, *map(str, args)], capture_output=True, text=True,
                          env=clean_env(), timeout=120, cwd=REPO)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("MODULES ")]
    assert lines, proc.stderr[-2000:]
    return proc.returncode, set(json.loads(lines[-1][len("MODULES "):]))


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("startup") / "ckpt")


def test_a_plain_verify_imports_its_command_alone_and_no_deep_machinery(st_dir: Path) -> None:
    code, loaded = modules(["verify", st_dir, "-q"])
    assert code == 0
    assert loaded & COMMAND_MODULES == {"ckptctl.cli.verify_cmd"}
    assert not loaded & DEEP_ONLY
    assert "rich.table" not in loaded  # -q on a clean checkpoint prints nothing


def test_deep_verify_and_help_load_what_they_need(st_dir: Path) -> None:
    """The probe is not blind: --deep brings the deep step, a table is rendered without -q when
    notes are shown, and --help builds every command."""
    code, loaded = modules(["verify", st_dir, "--deep", "-v"])
    assert code == 0 and {"ckptctl.verify.deep", "ckptctl.threads", "rich.table"} <= loaded
    code, loaded = modules(["--help"])
    assert code == 0 and COMMAND_MODULES <= loaded


def test_verify_restores_the_garbage_collector(st_dir: Path) -> None:
    assert gc.isenabled()
    result = invoke("verify", st_dir, "-q")
    assert result.exit_code == 0, result.stderr
    assert gc.isenabled()
    gc.disable()
    try:  # and leaves it off when it was off
        assert invoke("verify", st_dir, "-q").exit_code == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
