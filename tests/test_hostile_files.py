"""Hostile neighbours in a shared checkpoint tree (issue 15, DESIGN I12), on real files and real
processes: a FIFO, a device or a link to /dev/zero where config.json or tokenizer.json should be,
JSON nested deeper than the parser can follow, and a dead sibling staging directory whose lock is
a symbolic link or whose owner record is a FIFO. Nothing blocks (every run has a timeout far
below a hang), nothing reads without bound, no link is followed, every answer is clean."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from ckptctl.format import small
from tests.support import run_ckptctl, state, write_config, write_single

TIMEOUT = 60  # a blocked open or an endless read never finishes: the run times out and fails
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    write_single(tmp_path / "src", state(1, n=4))
    write_config(tmp_path / "src")
    return tmp_path / "src"


def _plant(d: Path, name: str, kind: str) -> None:
    p = d / name
    if p.exists() or p.is_symlink():
        p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev-zero-link":
        p.symlink_to("/dev/zero")
    elif kind == "device":
        os.mknod(p, 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's numbers
    elif kind == "deep":
        p.write_text(DEEP)


def _clean(r) -> None:
    assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr, r.stderr[-2000:]


KINDS = ["fifo", "dev-zero-link", "device"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_export_refuses_a_special_small_file_without_blocking(ckpt, tmp_path, kind, name):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    _plant(ckpt, name, kind)
    r = run_ckptctl("export", ckpt, tmp_path / "out", "--json", timeout=TIMEOUT)
    _clean(r)
    assert r.returncode == 2, r.stderr
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "input" and f"cannot read {name}: not a regular file" in err["message"], err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("kind", KINDS + ["deep"])
def test_inspect_and_verify_never_block_on_config_json(ckpt, kind):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    _plant(ckpt, "config.json", kind)
    r = run_ckptctl("inspect", ckpt, "--json", timeout=TIMEOUT)
    _clean(r)
    assert r.returncode == 0 and len(json.loads(r.stdout)["tensors"]) == 4
    r = run_ckptctl("verify", ckpt, "--json", timeout=TIMEOUT)
    _clean(r)
    assert r.returncode == 1, r.stderr  # a config.json that cannot be read is a finding
    codes = {f["code"] for res in json.loads(r.stdout)["results"] for f in res["findings"]}
    want = {"deep": "config.bad_json", "dev-zero-link": "dir.symlink_escape"}.get(kind, "dir.not_a_file")
    assert codes == {want}, codes


def test_resave_carries_a_fifo_tokenizer_without_opening_it(ckpt):
    """resave keeps the directory's other files by hard link: a FIFO is linked, never opened."""
    _plant(ckpt, "tokenizer.json", "fifo")
    r = run_ckptctl("resave", ckpt, "--dtype", "bf16", "--json", timeout=TIMEOUT)
    _clean(r)
    assert r.returncode == 0, r.stderr
    assert (ckpt / "tokenizer.json").is_fifo() and "tokenizer.json" in json.loads(r.stdout)["carried"]


def test_deeply_nested_config_is_a_clear_error_not_a_traceback(ckpt, tmp_path):
    _plant(ckpt, "config.json", "deep")
    r = run_ckptctl("export", ckpt, tmp_path / "out", "--dtype", "bf16", timeout=TIMEOUT)
    _clean(r)
    # config.json is carried as it is (its dtype cannot be synced): the export itself succeeds
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "config.json").read_text() == DEEP


def test_deeply_nested_manifest_is_a_finding(ckpt):
    (ckpt / "ckptctl.manifest.json").write_text(DEEP)
    r = run_ckptctl("verify", ckpt, "--json", timeout=TIMEOUT)
    _clean(r)
    assert r.returncode == 1
    codes = {f["code"] for res in json.loads(r.stdout)["results"] for f in res["findings"]}
    assert "manifest.bad_json" in codes, codes


# ---------------------------------------------------------------------------------------------
# the bounded reader itself


def test_the_bounded_reader(tmp_path):
    p = tmp_path / "big.json"
    p.write_bytes(b"[" + b"0," * 1000 + b"0]")
    assert small.read_json(p) == [0] * 1001
    with pytest.raises(small.TooLarge):
        small.read_small(p, limit=100)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(small.NotRegularFile, match="a FIFO"):
        small.read_small(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(p)
    with pytest.raises(small.NotRegularFile, match="symbolic link"):
        small.read_small(tmp_path / "link")
    assert small.read_small(tmp_path / "link", follow=True) == p.read_bytes()
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(small.NotRegularFile, match="character device"):
        small.read_small(tmp_path / "zero", follow=True)
    (tmp_path / "deep.json").write_text(DEEP)
    with pytest.raises(small.TooDeep):
        small.read_json(tmp_path / "deep.json")
    assert issubclass(small.TooDeep, ValueError) and issubclass(small.NotRegularFile, OSError)


# ---------------------------------------------------------------------------------------------
# a dead sibling staging directory with a symlinked lock or a FIFO owner record


def _dead_siblings(parent: Path, dest: str, target: Path) -> list[Path]:
    ours = parent / f"_tmp_{dest}.0000000000000001-00000001"  # a valid owner record, a dead pid
    ours.mkdir()
    (ours / "owner.json").write_text(json.dumps({"tool": "ckptctl", "pid": 1 << 22, "host": socket.gethostname(),
                                                 "dest": dest, "start_time": 1}))
    (ours / "lock").symlink_to(target)
    (ours / "data").mkdir()
    linked = parent / f"_tmp_{dest}.0000000000000002-00000002"  # not ours: no valid owner record
    linked.mkdir()
    (linked / "lock").symlink_to(target)
    (linked / "owner.json").write_text("{}")
    fifo = parent / f"_tmp_{dest}.0000000000000003-00000003"
    fifo.mkdir()
    os.mkfifo(fifo / "owner.json")
    (fifo / "lock").touch()
    deep = parent / f"_tmp_{dest}.0000000000000004-00000004"
    deep.mkdir()
    (deep / "owner.json").write_text(DEEP)
    (deep / "lock").touch()
    return [ours, linked, fifo, deep]


def test_dead_siblings_with_a_symlinked_lock_or_fifo_owner_never_block_or_get_followed(ckpt, tmp_path):
    target = tmp_path / "elsewhere" / "lock-target"  # where a followed link would create a file
    target.parent.mkdir()
    run_ckptctl("export", ckpt, tmp_path / "out", check=True)
    siblings = _dead_siblings(tmp_path, "out", target)
    # export (its recovery looks at every sibling, and at competitors before publishing)
    r = run_ckptctl("export", ckpt, tmp_path / "out", "--overwrite", "--json", timeout=TIMEOUT)
    _clean(r)
    assert r.returncode == 0, r.stderr
    assert not target.exists() and os.listdir(target.parent) == []
    # gc-tmp: nothing hangs or is followed; the not-ours ones are kept as unknown
    r = run_ckptctl("gc-tmp", tmp_path, "--min-age", "0", "--json", timeout=TIMEOUT)
    _clean(r)
    doc = json.loads(r.stdout)
    by_name = {Path(c["path"]).name: c for c in doc["candidates"]}
    for d in siblings[1:]:
        assert by_name[d.name]["decision"] == "kept" and by_name[d.name]["kind"] == "unknown", by_name[d.name]
    assert not target.exists() and os.listdir(target.parent) == []
    # the dead writer's own directory with a symlinked lock: its lock is nobody's, so it is dead;
    # it is not removed (gc-tmp removes only under the directory's own lock) and reported, exit 3
    assert by_name[siblings[0].name]["kind"] == "ours" and by_name[siblings[0].name]["decision"] == "failed"
    assert [e["path"] for e in doc["errors"]] == [str(siblings[0])] and "symbolic link" in doc["errors"][0]["message"]
    assert r.returncode == 3 and siblings[0].is_dir() and (tmp_path / "out" / "model.safetensors").is_file()
    assert "remove it by hand" in doc["errors"][0]["hint"]
    # the human form says what happened to the lock, not "fix the permissions"
    r = run_ckptctl("gc-tmp", tmp_path, "--min-age", "0", timeout=TIMEOUT)
    assert r.returncode == 3 and "symbolic link" in r.stderr and "remove it by hand" in r.stderr
    assert "fix the permissions" not in r.stderr
