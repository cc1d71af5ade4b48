"""How the CLI's process ends (``ckptctl.cli.leave``): the fast path (``CKPTCTL_FAST_EXIT``) skips
the interpreter's teardown after the exit handlers and a flush; ``sys.exit`` is the reference.
Both ways a command prints the same bytes, exits with the same code and runs its exit handlers;
only the reference frees the interpreter's objects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, clean_env, write_tiny_checkpoint

# the entry point, with an exit handler and an object that says when the interpreter frees it
ENTRY = ("import atexit, os, sys\n"
         "atexit.register(lambda: sys.stderr.write('EXIT-HANDLER\\n'))\n"
         "class Freed:\n"
         "    def __del__(self, write=os.write):  # (sys may be gone by then)\n"
         "        write(2, b'FREED\\n')\n"
         "kept = Freed()\n"
         "sys.argv[0] = 'ckptctl'\n"
         "from ckptctl.cli import main\n"
         "main()\n")


def _run(args: list[str], fast: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENTRY, *args], capture_output=True, cwd=REPO, timeout=300,
                          env=clean_env({"CKPTCTL_FAST_EXIT": "1" if fast else "0"}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("exit") / "ckpt")


@pytest.mark.parametrize("command", ["verify", "verify-json", "inspect-json", "export", "usage-error", "help"])
def test_both_ways_print_the_same_and_exit_alike(command, ckpt, tmp_path):
    args = {"verify": ["verify", str(ckpt), "--static"],
            "verify-json": ["verify", str(ckpt), "--static", "--json"],
            "inspect-json": ["inspect", str(ckpt), "--json"],
            "export": ["export", str(ckpt), str(tmp_path / "out-{}"), "--json"],
            "usage-error": ["verify", str(ckpt), "--no-such-option"],
            "help": ["--help"]}[command]
    runs = {}
    for fast in (True, False):
        argv = [a.replace("{}", str(fast)) for a in args]
        runs[fast] = _run(argv, fast)
    fast, ref = runs[True], runs[False]
    assert fast.returncode == ref.returncode, (fast.stderr, ref.stderr)
    assert ref.stderr.endswith(b"EXIT-HANDLER\nFREED\n")  # the reference tears the interpreter down
    assert fast.stderr.endswith(b"EXIT-HANDLER\n") and b"FREED" not in fast.stderr  # handlers ran, nothing freed
    assert fast.stderr[:-len(b"EXIT-HANDLER\n")] == ref.stderr[:-len(b"EXIT-HANDLER\nFREED\n")]
    out_fast, out_ref = fast.stdout.decode(), ref.stdout.decode()
    if command == "export":  # each wrote its own destination, named in its document
        out_fast, out_ref = (json.loads(o) for o in (out_fast, out_ref))
        for doc in (out_fast, out_ref):
            for varies in ("dest", "seconds", "space_available"):  # where, and when
                doc.pop(varies)
    assert out_fast == out_ref
    if command in ("verify", "verify-json", "inspect-json", "help"):
        assert ref.returncode == 0


def test_a_command_that_imported_torch_exits_the_usual_way(ckpt):
    """Torch's own teardown is not skipped: with torch imported the fast path steps aside."""
    proc = subprocess.run([sys.executable, "-c", "import torch\n" + ENTRY, "verify", str(ckpt), "--static"],
                          capture_output=True, cwd=REPO, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.endswith(b"EXIT-HANDLER\nFREED\n")
