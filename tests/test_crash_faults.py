"""The crash campaign's fault injection (issue #8), no mocks: real filesystems (a mount point as the
destination, a source on another filesystem, ENOSPC on a small tmpfs, a read-only remount,
RLIMIT_FSIZE, permissions denied for real), errors injected at each phase
(``CKPTCTL_FAIL_AT=<point>:<ERRNO>``), a destination swapped for a symlink and a second writer
while a writer is stopped, Ctrl-C; and the fsync order (I7) read off the real system calls with
strace. The kills themselves are in test_crash_campaign.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import crash_harness as H
from tests.crash_harness.fixtures import prepared, zygote  # noqa: F401 (fixtures)
from tests.support import (clean_env, drop_dac_caps, fill_filesystem, run_ckptctl, wait_stopped, write_sharded,
                           write_single)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# Fault injection on real filesystems


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "error:" in err, err


@pytest.mark.parametrize("command", ["export", "resave"])
def test_destination_that_is_a_mount_point_is_refused_before_any_work(prepared, zygote, tmp_path, mount_tmpfs,
                                                                      command):
    """EXDEV: a mount point cannot be replaced by rename; staging beside it would be on another
    filesystem. Refused in the plan phase; nothing is written on either side."""
    prep = prepared("export-sharded-to-single")
    p = prep.instantiate(tmp_path / "t")
    old = p.ws / "old-copy"
    shutil.move(p.dst, old)
    mount_tmpfs(p.dst)
    shutil.copytree(old, p.dst, dirs_exist_ok=True)
    before_ws, before_mnt = H.snapshot(p.ws, skip=lambda rel: rel.startswith(H.DEST)), H.snapshot(p.dst)
    argv = (["export", p.src, p.dst, "--overwrite"] if command == "export" else ["resave", p.dst, "--dtype", "bf16"])
    r = zygote.run(argv)
    assert r.rc == 3 and "mount point" in r.stderr and "(phase: plan)" in r.stderr, r.stderr
    _no_traceback(r.stderr)
    assert H.snapshot(p.dst) == before_mnt and H.snapshot(p.ws, skip=lambda rel: rel.startswith(H.DEST)) == before_ws


def test_kernel_copy_from_another_filesystem_falls_back_to_streaming(prepared, zygote, tmp_path, mount_tmpfs):
    """EXDEV from copy_file_range (source on a tmpfs, destination on this disk): the bytes are
    streamed instead, and the result is byte-identical to the kernel-copied one."""
    prep = prepared("export-sharded-to-single")
    p = prep.instantiate(tmp_path / "t")
    src2 = mount_tmpfs(tmp_path / "mnt") / "src"
    shutil.copytree(p.src, src2)
    if os.stat(src2).st_dev == os.stat(p.ws).st_dev:
        pytest.skip("the tmpfs is not another filesystem")
    same = zygote.run(["export", p.src, p.ws / "same", "--json"])
    cross = zygote.run(["export", src2, p.ws / "cross", "--json"])
    assert same.rc == 0 and cross.rc == 0, cross.stderr
    a, b = json.loads(same.stdout), json.loads(cross.stdout)
    assert a["bytes_copied_by_kernel"] == a["total_size"] and a["bytes_streamed"] == 0
    assert b["bytes_copied_by_kernel"] == 0 and b["bytes_streamed"] == b["total_size"] > 0
    assert H.snapshot(p.ws / "same") == H.snapshot(p.ws / "cross")
    assert H.check_version(p.ws / "cross", prep.new_tensors) == []


def _can_drop_dac(zygote, tmp_path: Path) -> None:
    """Skip unless a command run with ``drop_dac`` really is denied by file permissions (as root:
    without CAP_DAC_OVERRIDE / CAP_FOWNER; as another user: always)."""
    probe, src = tmp_path / "probe", tmp_path / "probe-src"
    write_single(src, H.model_state(0, n=1, rows=2, cols=2))
    probe.mkdir()
    os.chmod(probe, 0o555)
    try:
        forked = zygote.run(["export", src, probe / "x"], drop_dac=True)
        h = subprocess.run([sys.executable, "-c", "import os,sys; os.mkdir(sys.argv[1])", str(probe / "d")],
                           preexec_fn=drop_dac_caps if os.geteuid() == 0 else None, capture_output=True)
    finally:
        os.chmod(probe, 0o755)
        shutil.rmtree(src)
    if forked.rc != 3 or "permission denied" not in forked.stderr or h.returncode == 0:
        pytest.skip("file permissions do not apply to commands run here")


def test_eacces_on_the_parent_fails_in_the_stage_phase(prepared, zygote, tmp_path):
    _can_drop_dac(zygote, tmp_path)
    prep = prepared("export-sharded-to-single")
    p = prep.instantiate(tmp_path / "t")
    os.chmod(p.ws, 0o555)
    try:
        r = zygote.run(prep.scn.argv(p.src, p.dst), drop_dac=True)
    finally:
        os.chmod(p.ws, 0o755)
    assert r.rc == 3 and "permission denied" in r.stderr and "(phase: stage)" in r.stderr, r.stderr
    _no_traceback(r.stderr)
    assert H.classify(p.dst, prep) == "old" and H.our_staging(p.ws) == []


@pytest.mark.parametrize("command", ["export", "resave"])
def test_eacces_after_the_data_is_written_removes_the_staging(prepared, zygote, tmp_path, command):
    """An unreadable directory of the old version (carried over into the new one) fails the
    finalize phase after every shard was written: exit 3, old version intact, staging removed."""
    _can_drop_dac(zygote, tmp_path)
    prep = prepared("export-single-to-sharded" if command == "export" else "resave-dtype")
    p = prep.instantiate(tmp_path / "t")
    private = p.dst / "private"
    private.mkdir()
    (private / "notes").write_text("x")
    os.chmod(private, 0)
    before = H.snapshot(p.ws)
    try:
        r = zygote.run(prep.scn.argv(p.src, p.dst), drop_dac=True)
    finally:
        os.chmod(private, 0o755)
    assert r.rc == 3 and "permission denied" in r.stderr and "(phase: finalize)" in r.stderr, r.stderr
    _no_traceback(r.stderr)
    assert "wrote model" in r.stderr  # it failed after writing data
    assert H.snapshot(p.ws) == before and H.our_staging(p.ws) == []


def test_eacces_on_a_source_shard_names_the_phase(prepared, zygote, tmp_path):
    _can_drop_dac(zygote, tmp_path)
    prep = prepared("export-single-to-sharded")
    p = prep.instantiate(tmp_path / "t")
    os.chmod(p.src / "model-00002-of-00003.safetensors", 0)
    r = zygote.run(prep.scn.argv(p.src, p.dst), drop_dac=True)
    assert r.rc == 3 and "permission denied" in r.stderr
    assert H.classify(p.dst, prep) == "old" and H.our_staging(p.ws) == []
    assert "(phase: " in r.stderr, r.stderr


ERRNO_SCENARIOS = ["export-single-to-sharded", "export-new-destination", "resave-dtype", "resave-repair"]
ERRNO = [pytest.param(s, p, e, id=f"{s}-{e}@{p}") for s in ERRNO_SCENARIOS for p, e in H.errno_faults(H.SCENARIOS[s])]


@pytest.mark.parametrize("scenario,point,err", ERRNO)
def test_errno_at_each_phase_exits_3_names_the_phase_and_cleans_up(prepared, zygote, tmp_path, scenario, point, err):
    o = H.run_errno_trial(prepared(scenario), point, err, tmp_path / "t", zygote)
    assert not o.violations, o


def test_fsync_error_after_the_rename_says_the_new_version_is_in_place(prepared, zygote, tmp_path):
    prep = prepared("export-sharded-to-single")
    p = prep.instantiate(tmp_path / "t")
    r = zygote.run(prep.scn.argv(p.src, p.dst), env={"CKPTCTL_FAIL_AT": "published:EIO"})
    assert r.rc == 3 and "(phase: publish)" in r.stderr
    assert H.classify(p.dst, prep) == "new" and H.our_staging(p.ws) == []  # this part holds
    assert "nothing was published" not in r.stderr, r.stderr


def test_destination_swapped_for_a_symlink_while_the_writer_is_stopped(prepared, zygote, tmp_path):
    """K21: the writer stops after its shards; someone moves the old version away and puts a
    symlink to another checkpoint at the destination. The link is replaced as a link: its target
    is never written to or removed, and the destination ends up a complete version."""
    prep = prepared("export-sharded-to-single")
    p = prep.instantiate(tmp_path / "t")
    target = tmp_path / "elsewhere"
    shutil.copytree(prep.template / "ws" / "other", target)
    (target / "README.md").write_text("the link target's card\n")
    target_before = H.snapshot(target)
    h = zygote.start(prep.scn.argv(p.src, p.dst), env={"CKPTCTL_STOP_AT": "shards-written"})
    wait_stopped(h.pid)
    moved = p.ws / "moved-away"
    os.rename(p.dst, moved)
    os.symlink(target, p.dst)
    os.kill(h.pid, signal.SIGCONT)
    r = h.wait()
    assert H.snapshot(target) == target_before  # the link's target is intact
    assert H.snapshot(moved) == prep.old_snapshot  # the moved old version too
    assert H.our_staging(p.ws) == []
    if r.rc == 0:
        assert not p.dst.is_symlink()
        assert H.check_version(p.dst, prep.new_tensors) == [] and H.check_marker(p.dst) == []
    else:
        assert r.rc == 3 and "(phase: " in r.stderr, r.stderr
        _no_traceback(r.stderr)
        assert p.dst.is_symlink() and os.readlink(p.dst) == str(target)


def test_resave_ctrl_c_cleans_up_and_exits_130(prepared, zygote, tmp_path):
    prep = prepared("resave-dtype")
    p = prep.instantiate(tmp_path / "t")
    before = H.snapshot(p.ws)
    h = zygote.start(prep.scn.argv(p.src, p.dst), env={"CKPTCTL_STOP_AT": "write-chunk"})
    wait_stopped(h.pid)
    assert len(H.our_staging(p.ws)) == 1
    os.kill(h.pid, signal.SIGINT)
    os.kill(h.pid, signal.SIGCONT)
    r = h.wait()
    assert r.rc == 130 and "interrupted" in r.stderr, r.stderr
    _no_traceback(r.stderr)
    assert H.snapshot(p.ws) == before and H.our_staging(p.ws) == []


def test_second_resave_of_the_same_directory_is_refused(prepared, zygote, tmp_path):
    prep = prepared("resave-dtype")
    p = prep.instantiate(tmp_path / "t")
    first = zygote.start(prep.scn.argv(p.src, p.dst), env={"CKPTCTL_STOP_AT": "shards-written"})
    wait_stopped(first.pid)
    try:
        r = zygote.run(prep.scn.argv(p.src, p.dst))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert r.rc == 3 and "another writer" in r.stderr, r.stderr
    assert first.wait().rc == 0
    assert H.snapshot(p.dst) == prep.new_snapshot and H.our_staging(p.ws) == []


def test_resave_enospc_on_a_small_tmpfs(zygote, tmp_path, mount_tmpfs):
    mnt = mount_tmpfs(tmp_path / "mnt", size="1m")
    dst = mnt / "ckpt"
    write_sharded(dst, H.model_state(4, n=4, rows=128, cols=128), max_shard_size=70_000)  # 256 KiB fp32
    before = H.snapshot(mnt)
    h = zygote.start(["resave", dst, "--dtype", "fp16"], env={"CKPTCTL_STOP_AT": "stage-created"})
    wait_stopped(h.pid)
    filler = fill_filesystem(mnt / "filler", leave=40_000)  # room for less than the new data
    os.kill(h.pid, signal.SIGCONT)
    r = h.wait()
    filler.unlink()
    assert r.rc == 3 and "no space left" in r.stderr and "(phase: " in r.stderr, r.stderr
    _no_traceback(r.stderr)
    assert H.snapshot(mnt) == before and H.our_staging(mnt) == []


def test_resave_rlimit_fsize(prepared, tmp_path):
    prep = prepared("resave-dtype")
    p = prep.instantiate(tmp_path / "t")
    before = H.snapshot(p.ws)
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (5_000, 5_000))  # under each 8,192-byte shard (resave --dtype keeps the 3 shards)

    r = run_ckptctl(*prep.scn.argv(p.src, p.dst), preexec_fn=limit, timeout=300)
    assert r.returncode == 3 and "(phase: write)" in r.stderr, r.stderr
    _no_traceback(r.stderr)
    assert H.snapshot(p.ws) == before and H.our_staging(p.ws) == []


def test_resave_on_a_read_only_filesystem(prepared, zygote, tmp_path, mount_tmpfs):
    mnt = mount_tmpfs(tmp_path / "mnt", size="4m")
    write_sharded(mnt / "ckpt", H.model_state(1), max_shard_size=20_000)
    before = H.snapshot(mnt)
    if subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot remount read-only")
    r = zygote.run(["resave", mnt / "ckpt", "--dtype", "bf16"])
    assert r.rc == 3 and "read-only" in r.stderr and "(phase: plan)" in r.stderr, r.stderr
    assert H.snapshot(mnt) == before


# ---------------------------------------------------------------------------------------------
# Durability (I7): the fsync order, read off the real system calls


def _strace(tmp_path: Path, argv: list, *, drop_dac: bool = False) -> list[str]:
    if not shutil.which("strace"):
        pytest.skip("strace is not installed")
    log = tmp_path / "strace.log"
    cmd = ["strace", "-f", "-y", "-qq", "-o", str(log), "-e",
           "trace=openat,fsync,fdatasync,renameat2,rename,link,linkat,mkdir,symlink,copy_file_range,sendfile",
           sys.executable, "-m", "ckptctl", *map(str, argv)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=300,
                       preexec_fn=drop_dac_caps if drop_dac and os.geteuid() == 0 else None)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip("ptrace is not permitted here")
    assert r.returncode == 0, r.stderr
    # one line per finished call: a call another thread interrupted ("<unfinished ...>" then
    # "<... fsync resumed>") is joined back together, by thread id
    out, pending = [], {}
    for line in log.read_text().splitlines():
        m = re.match(r"^(\d+)\s+(.*)$", line)
        if not m:
            continue
        tid, rest = m.groups()
        if rest.endswith("<unfinished ...>"):
            pending[tid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        r = re.match(r"^<\.\.\. \w+ resumed>(.*)$", rest)
        if r and tid in pending:
            rest = pending.pop(tid) + r.group(1)
        out.append(rest)
    return out


def _durability_problems(trace: list[str], ws: Path) -> list[str]:
    """Every file this process wrote into the staging data/ was fsynced before `ready`; data/ was
    fsynced before `ready`; `ready` and the staging directory before the publish rename; the
    parent after it."""
    staging = re.escape(str(ws)) + r"/_tmp_ckpt\.[0-9a-f]{16}-[0-9a-f]{8}"
    written, synced, problems = [], set(), []
    order: list[tuple[str, str]] = []
    for line in trace:
        m = re.match(rf'openat\(.*"({staging}/data/[^"]+)", O_WRONLY\|O_CREAT', line)
        if m:
            written.append(m.group(1))
        m = re.match(r"fsync\(\d+<([^>]+)>\)\s+= 0", line)
        if m:
            synced.add(m.group(1))
            order.append(("fsync", m.group(1)))
        if re.match(rf'openat\(.*"{staging}/ready", O_WRONLY\|O_CREAT', line):
            order.append(("create-ready", ""))
            problems += [f"{f} not fsynced before ready" for f in written if f not in synced]
        if line.startswith("renameat2("):
            order.append(("rename", line))
    kinds = [k for k, _ in order]
    if "create-ready" not in kinds or "rename" not in kinds:
        return problems + [f"no ready/rename in the trace: {kinds}"]
    ready_at, rename_at = kinds.index("create-ready"), kinds.index("rename")
    synced_before_ready = [p for k, p in order[:ready_at] if k == "fsync"]
    synced_between = [p for k, p in order[ready_at:rename_at] if k == "fsync"]
    synced_after = [p for k, p in order[rename_at:] if k == "fsync"]
    if not any(re.fullmatch(f"{staging}/data", p) for p in synced_before_ready):
        problems.append("data/ not fsynced before ready")
    if not any(p.endswith("/ready") for p in synced_between) or not any(
            re.fullmatch(staging, p) for p in synced_between):
        problems.append("ready and the staging directory not fsynced before the rename")
    if str(ws) not in synced_after:
        problems.append("parent not fsynced after the rename")
    return problems


@pytest.mark.parametrize("scenario", ["export-single-to-sharded", "resave-repair"])
def test_every_file_written_is_fsynced_before_ready_and_the_parent_after_the_rename(prepared, tmp_path, scenario):
    prep = prepared(scenario)
    p = prep.instantiate(tmp_path / "t")
    trace = _strace(tmp_path, prep.scn.argv(p.src, p.dst))
    assert any("RENAME_EXCHANGE" in line for line in trace)
    assert _durability_problems(trace, p.ws) == []
    assert H.snapshot(p.dst) == prep.new_snapshot


def test_a_carried_file_that_cannot_be_hard_linked_is_fsynced_too(prepared, zygote, tmp_path):
    if Path("/proc/sys/fs/protected_hardlinks").read_text().strip() != "1":
        pytest.skip("fs.protected_hardlinks is off: linking cannot fail this way")
    _can_drop_dac(zygote, tmp_path)
    prep = prepared("export-sharded-to-single")
    p = prep.instantiate(tmp_path / "t")
    readme = p.dst / "README.md"
    os.chown(readme, 65534, 65534)  # someone else's file: linking it is refused (EPERM)
    os.chmod(readme, 0o644)
    trace = _strace(tmp_path, prep.scn.argv(p.src, p.dst), drop_dac=True)
    assert any(line.startswith("link(") and "README.md" in line and "EPERM" in line for line in trace)
    assert (p.dst / "README.md").read_text() == "old model card\n"
    assert _durability_problems(trace, p.ws) == []
