"""ckptctl/errors.py: every error class -> its exit code (README "Exit codes") and stable code,
the phase in its message and JSON, errno -> error class; then the CLI's mapping, through one real
``python -m ckptctl`` run per error class."""

from __future__ import annotations

import errno
import importlib
import json
import os
import pkgutil
import signal
import subprocess
from pathlib import Path

import pytest

import ckptctl
from ckptctl import errors as E
from ckptctl.distributed import DistributedWriteError
from tests.support import popen_ckptctl, run_ckptctl, state, wait_stopped, write_sharded, write_single

# README "Exit codes": 1 findings / repair refused, 2 usage or bad input, 3 operational, 130 Ctrl-C
EXPECTED = {
    E.CkptctlError: (3, "error"),
    E.UsageError: (2, "usage"),
    E.InputError: (2, "input"),
    E.OperationalError: (3, "operational"),
    E.LockHeldError: (3, "lock_held"),
    E.DiskFullError: (3, "disk_full"),
    E.UnrepairableError: (1, "unrepairable"),
    E.Interrupted: (130, "interrupted"),
    DistributedWriteError: (3, "distributed"),
}


def _all_error_classes() -> set[type]:
    for mod in pkgutil.walk_packages(ckptctl.__path__, "ckptctl."):
        if mod.name != "ckptctl.__main__":
            importlib.import_module(mod.name)
    found, todo = set(), [E.CkptctlError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return found


def test_every_error_class_has_a_documented_exit_code():
    """A class in the table, or a subclass that keeps its parent's exit code and code (e.g. a
    module's private refinement of UnrepairableError): a new exit code or code needs its row here
    and in README."""
    found = _all_error_classes()
    assert set(EXPECTED) <= found
    for cls in found - set(EXPECTED):
        parent = next(c for c in cls.__mro__ if c in EXPECTED)
        assert (cls.exit_code, cls.code) == EXPECTED[parent], f"{cls.__module__}.{cls.__qualname__}"


def test_the_exit_code_constants_are_the_documented_ones():
    assert (E.EXIT_OK, E.EXIT_FINDINGS, E.EXIT_USAGE, E.EXIT_OPERATIONAL, E.EXIT_INTERRUPTED) == (0, 1, 2, 3, 130)


@pytest.mark.parametrize("cls", [c for c in EXPECTED if c is not DistributedWriteError], ids=lambda c: c.__name__)
def test_each_class_has_its_exit_code_code_and_phase(cls):
    exit_code, code = EXPECTED[cls]
    err = cls("it broke", "do this next", phase="write")
    assert (err.exit_code, err.code) == (exit_code, code)
    assert str(err) == "it broke (phase: write)" and err.message == "it broke" and err.hint == "do this next"
    assert err.to_dict() == {"code": code, "message": "it broke", "hint": "do this next", "phase": "write",
                             "exit_code": exit_code}
    bare = cls("it broke")
    assert str(bare) == "it broke" and bare.phase is None and bare.hint is None
    assert isinstance(err, E.CkptctlError) and isinstance(err, Exception)


def test_a_distributed_error_names_the_phase_and_every_failed_rank():
    err = DistributedWriteError("write", {3: "disk full", 1: "killed"})
    assert (err.exit_code, err.code, err.phase) == (3, "distributed", "write")
    assert str(err) == "multi-rank write failed in phase write: rank 1: killed; rank 3: disk full (phase: write)"
    assert err.failures == {3: "disk full", 1: "killed"} and "nothing was published" in err.hint


@pytest.mark.parametrize("err,cls,words", [
    (errno.ENOSPC, E.DiskFullError, "no space left"), (errno.EDQUOT, E.DiskFullError, "no space left"),
    (errno.EFBIG, E.DiskFullError, "no space left"), (errno.EACCES, E.OperationalError, "permission denied"),
    (errno.EPERM, E.OperationalError, "permission denied"), (errno.EROFS, E.OperationalError, "read-only"),
    (errno.ENOENT, E.OperationalError, "no such file or directory"),
    (errno.EXDEV, E.OperationalError, "different filesystems"), (errno.EIO, E.OperationalError, "I/O error"),
    (errno.EBUSY, E.OperationalError, "Device or resource busy"),
], ids=lambda v: errno.errorcode.get(v, "") if isinstance(v, int) else None)
def test_an_oserror_becomes_the_error_its_errno_means(err, cls, words):
    exc = OSError(err, os.strerror(err), "/data/ckpt/model.safetensors")
    got = E.from_oserror(exc, "writing the shard", phase="write")
    assert type(got) is cls and got.phase == "write" and got.hint
    assert str(got).startswith("writing the shard: ") and words in str(got)
    assert "/data/ckpt/model.safetensors" in got.message and str(got).endswith("(phase: write)")
    without_name = E.from_oserror(OSError(err, "x"), "writing the shard")
    assert without_name.phase is None and without_name.message.startswith("writing the shard: ")
    assert without_name.message.count("writing the shard") == 1 and " at " not in without_name.message
    assert got.exit_code == (2 if cls is E.InputError else 3)


# ---------------------------------------------------------------------------------------------
# the CLI: one real run per error class, JSON error document included. Already covered elsewhere:
# exit 0 and InputError (test_cli_conventions.py: test_success_streams, test_missing_path_json),
# verify's exit 1 for findings (test_verify_cli.py).


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    write_single(tmp_path / "src", state(1, n=4))
    return tmp_path / "src"


def _json_error(out: str) -> dict:
    doc = json.loads(out)
    assert doc["ok"] is False
    return doc["error"]


def _expect(r: subprocess.CompletedProcess, cls: type) -> None:
    """Exit code, one JSON document naming the class's code, one error line and a hint."""
    exit_code, code = EXPECTED[cls]
    assert r.returncode == exit_code, r.stderr
    err = _json_error(r.stdout)
    assert (err["code"], err["exit_code"]) == (code, exit_code)
    assert r.stderr.startswith("error: ") and "hint: " in r.stderr and "Traceback" not in r.stderr


def test_exit_1_unrepairable(tmp_path):
    d = tmp_path / "c"
    write_sharded(d, state(1), per_shard=2)
    (d / "model-00002-of-00003.safetensors").unlink()
    before = sorted(p.name for p in d.iterdir())
    r = run_ckptctl("resave", d, "--repair", "--json")
    _expect(r, E.UnrepairableError)
    assert "tensors are lost" in r.stderr and sorted(p.name for p in d.iterdir()) == before


def test_exit_2_usage_error(ckpt, tmp_path):
    (tmp_path / "dst").mkdir()
    r = run_ckptctl("export", ckpt, tmp_path / "dst", "--json")
    _expect(r, E.UsageError)
    assert "--overwrite" in r.stderr


@pytest.mark.parametrize("fault,cls", [("fsync-shard:EIO", E.OperationalError),
                                       ("write-data:ENOSPC", E.DiskFullError)])
def test_exit_3_operational_errors(ckpt, tmp_path, fault, cls):
    r = run_ckptctl("export", ckpt, tmp_path / "dst", "--json", env={"CKPTCTL_FAIL_AT": fault})
    _expect(r, cls)
    assert _json_error(r.stdout)["phase"] == "write" and not (tmp_path / "dst").exists()


def _stopped_writer(ckpt: Path, dst: Path):
    proc = popen_ckptctl("export", ckpt, dst, "--json", env={"CKPTCTL_STOP_AT": "shards-written"})
    wait_stopped(proc.pid)
    return proc


def test_exit_3_lock_held(ckpt, tmp_path):
    first = _stopped_writer(ckpt, tmp_path / "dst")
    try:
        r = run_ckptctl("export", ckpt, tmp_path / "dst", "--json")
    finally:
        first.send_signal(signal.SIGCONT)
    _expect(r, E.LockHeldError)
    assert first.wait(timeout=120) == 0


def test_exit_130_interrupted(ckpt, tmp_path):
    proc = _stopped_writer(ckpt, tmp_path / "dst")
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    _expect(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), E.Interrupted)
    assert not (tmp_path / "dst").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def test_readme_documents_every_exit_code():
    """README's "Exit codes" table has a row for every code the tool can exit with: the classes',
    the signals' (128 + SIGHUP/SIGINT/SIGTERM) and a closed stdout's."""
    import re
    import signal
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme[readme.index("### Exit codes"):].split("\n\n", 2)[1]
    rows = {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.M)}
    signals = {E.EXIT_SIGNAL_BASE + s for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}
    assert rows == {E.EXIT_OK} | {c for c, _ in EXPECTED.values()} | signals | {E.EXIT_BROKEN_PIPE}
