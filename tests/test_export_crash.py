"""Kill -9 at every phase, injected faults, a second writer and Ctrl-C, with real processes."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ckptctl import staging
from tests.support import (fill_filesystem, load_glob, load_hub, popen_ckptctl, run_ckptctl, same, staging_dirs,
                           state, wait_stopped, write_sharded, write_single)

KILL_POINTS = ["stage-created", "shard-start", "write-data", "fsync-shard", "shards-written", "index",
               "extras-written", "manifest-written", "sealed", "publish", "published", "after-publish"]


def _setup(tmp_path: Path) -> tuple[Path, Path, dict, dict]:
    old, new = state(1), state(2)
    src = tmp_path / "src"
    write_sharded(src, new, per_shard=2)
    (src / "config.json").write_text('{"model_type": "llama"}')
    dst = tmp_path / "dst"
    write_single(dst, old)
    (dst / "README.md").write_text("keep me")
    return src, dst, old, new


def _is_old_or_new(dst: Path, old: dict, new: dict) -> str:
    got = load_glob(dst)
    assert same(got, load_hub(dst)), "glob and index-first loaders disagree"
    if same(got, old):
        return "old"
    assert same(got, new), "destination holds a mix"
    return "new"


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill9_at_each_phase_leaves_old_or_new(tmp_path, point):
    src, dst, old, new = _setup(tmp_path)
    args = ["export", str(src), str(dst), "--overwrite", "--max-shard-size", "20KB", "--manifest"]
    p = run_ckptctl(*args, env={"CKPTCTL_KILL_AT": point})
    assert p.returncode == -signal.SIGKILL, (point, p.returncode, p.stderr)
    version = _is_old_or_new(dst, old, new)
    assert version == ("new" if point in ("published", "after-publish") else "old")
    assert (dst / "README.md").read_text() == "keep me"
    for d in staging_dirs(tmp_path):  # leftovers are recognisably ours
        assert staging.parse_name(d.name) and staging.read_owner(d)["dest"] == "dst"
    # I8: running again gives the same bytes as a clean run
    run_ckptctl(*args, check=True)
    assert _is_old_or_new(dst, old, new) == "new"
    run_ckptctl("export", str(src), str(tmp_path / "clean"), "--max-shard-size", "20KB", check=True)
    for name in os.listdir(tmp_path / "clean"):
        assert (dst / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name


def test_kill9_at_random_moments_during_data_writes(tmp_path):
    src = tmp_path / "src"
    big = state(5, n=8, rows=1024, cols=1024)  # 32 MiB
    write_single(src, big)
    dst = tmp_path / "dst"
    write_single(dst, state(6, n=2))
    old = load_glob(dst)
    rng = random.Random(1234)
    for _ in range(4):
        proc = popen_ckptctl("export", src, dst, "--overwrite", "--dtype", "bf16", "--max-shard-size", "8MB",
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = load_glob(dst)
        assert same(got, old) or same(got, {k: v.bfloat16() for k, v in big.items()})
        old = got


def test_fsync_eio_aborts_and_is_not_retried(tmp_path):
    src, dst, old, new = _setup(tmp_path)
    p = run_ckptctl("export", str(src), str(dst), "--overwrite", env={"CKPTCTL_FAIL_AT": "fsync-shard:EIO"})
    assert p.returncode == 3 and "I/O error" in p.stderr and "phase: write" in p.stderr
    assert _is_old_or_new(dst, old, new) == "old"
    assert staging_dirs(tmp_path) == []


def test_exchange_unsupported_falls_back_to_journaled_two_rename(tmp_path):
    src, dst, old, new = _setup(tmp_path)
    p = run_ckptctl("export", str(src), str(dst), "--overwrite", "--json",
                    env={"CKPTCTL_FAIL_AT": "exchange:EINVAL"})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["publish"] == "two-rename"
    assert _is_old_or_new(dst, old, new) == "new" and staging_dirs(tmp_path) == []


def test_crash_between_the_two_renames_is_recovered_by_next_run(tmp_path):
    src, dst, old, new = _setup(tmp_path)
    p = run_ckptctl("export", str(src), str(dst), "--overwrite",
                    env={"CKPTCTL_FAIL_AT": "exchange:EINVAL", "CKPTCTL_KILL_AT": "two-rename-between"})
    assert p.returncode == -signal.SIGKILL
    assert not dst.exists()  # the window the journal covers
    [leftover] = staging_dirs(tmp_path)
    assert (leftover / "old").is_dir() and (leftover / "ready").exists()
    # the next run on the same destination rolls the complete new version forward first
    p = run_ckptctl("export", str(src), str(dst), "--overwrite", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["recovered"] and _is_old_or_new(dst, old, new) == "new"
    assert staging_dirs(tmp_path) == []


def test_exchange_failure_leaves_old_intact(tmp_path):
    src, dst, old, new = _setup(tmp_path)
    p = run_ckptctl("export", str(src), str(dst), "--overwrite", env={"CKPTCTL_FAIL_AT": "exchange:EIO"})
    assert p.returncode == 3 and "phase: publish" in p.stderr
    assert _is_old_or_new(dst, old, new) == "old" and staging_dirs(tmp_path) == []


@pytest.fixture
def small_fs(tmp_path, mount_tmpfs):
    return mount_tmpfs(tmp_path / "mnt", size="1m")


def test_enospc_on_small_tmpfs(tmp_path, small_fs):
    src = tmp_path / "src"
    write_single(src, state(1, n=4, rows=256, cols=256))  # 1 MiB of tensors
    dst = small_fs / "out"
    write_single(dst, state(2, n=1, rows=8, cols=8))
    old = load_glob(dst)
    # the free-space check refuses before anything is written
    p = run_ckptctl("export", str(src), str(dst), "--overwrite")
    assert p.returncode == 3 and "not enough free space" in p.stderr, p.stderr
    assert same(load_glob(dst), old) and staging_dirs(small_fs) == []
    # a real ENOSPC in the middle of the data: the disk fills up after the check passed
    write_single(tmp_path / "src2", state(3, n=4, rows=128, cols=128))  # 256 KiB
    proc = popen_ckptctl("export", tmp_path / "src2", dst, "--overwrite", env={"CKPTCTL_STOP_AT": "stage-created"})
    wait_stopped(proc.pid)
    fill_filesystem(small_fs / "filler", leave=100_000)  # room for less than the data
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "no space left" in err and "phase: write" in err, err
    assert same(load_glob(dst), old) and staging_dirs(small_fs) == []


def test_rlimit_fsize_gives_clean_error(tmp_path):
    src, dst, old, new = _setup(tmp_path)
    p = run_ckptctl("export", src, dst, "--overwrite",
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000)))
    assert p.returncode == 3, p.stderr
    assert "error:" in p.stderr and "Traceback" not in p.stderr
    assert _is_old_or_new(dst, old, new) == "old" and staging_dirs(tmp_path) == []


def test_read_only_destination_filesystem(tmp_path, small_fs):
    write_single(small_fs / "out", state(2, n=1, rows=8, cols=8))
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot remount read-only")
    write_single(tmp_path / "src", state(1, n=1))
    p = run_ckptctl("export", str(tmp_path / "src"), str(small_fs / "out"), "--overwrite")
    assert p.returncode == 3 and "read-only" in p.stderr
    p = run_ckptctl("export", str(tmp_path / "src"), str(small_fs / "new"))
    assert p.returncode == 3 and "read-only" in p.stderr


def _start_paused_writer(src: Path, dst: Path, tmp_path: Path) -> subprocess.Popen:
    proc = popen_ckptctl("export", src, dst, "--overwrite", "--dtype", "bf16")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        dirs = staging_dirs(dst.parent)
        if dirs and any((dirs[0] / "data").glob("*.safetensors")):
            proc.send_signal(signal.SIGSTOP)
            return proc
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("writer never started writing")


def test_second_writer_is_refused_and_first_completes(tmp_path):
    src = tmp_path / "src"
    big = state(5, n=8, rows=1024, cols=1024)
    write_single(src, big)
    dst = tmp_path / "dst"
    write_single(dst, state(6, n=1))
    first = _start_paused_writer(src, dst, tmp_path)
    try:
        p = run_ckptctl("export", str(src), str(dst), "--overwrite")
        assert p.returncode == 3 and "another writer" in p.stderr, p.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=120) == 0
    assert same(load_glob(dst), {k: v.bfloat16() for k, v in big.items()})
    assert staging_dirs(tmp_path) == []


def test_ctrl_c_cleans_up_and_exits_130(tmp_path):
    src = tmp_path / "src"
    write_single(src, state(5, n=8, rows=1024, cols=1024))
    dst = tmp_path / "dst"
    write_single(dst, state(6, n=1))
    old = load_glob(dst)
    proc = _start_paused_writer(src, dst, tmp_path)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert same(load_glob(dst), old) and staging_dirs(tmp_path) == []


def test_symlinked_destination_is_replaced_as_a_link(tmp_path):
    real = tmp_path / "real"
    write_single(real, state(1))
    link = tmp_path / "latest"
    link.symlink_to(real)
    write_single(tmp_path / "src", state(2))
    run_ckptctl("export", str(tmp_path / "src"), str(link), "--overwrite", check=True)
    assert not link.is_symlink() and same(load_glob(link), state(2))
    assert same(load_glob(real), state(1))  # the link's target is untouched
