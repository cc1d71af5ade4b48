"""The fast crash campaign (issue #8): SIGKILL at every named phase of export --overwrite and resave,
random kills during data writes, a reader polling during publishes, fault injection without mocks,
and the fsync order (I7) read off the real syscalls.

Every trial runs the real CLI in a real process (forked from a warm interpreter, see
``tests.support.zygote.ZygoteRunner``; two trials use a fresh ``python -m ckptctl`` to show it is
the same), with fsync on, and checks I1, I2, I4 and I8 with ``crash_harness.run_trial``. The long
mode is ``python -m bench.crash_campaign``; its measured table is in docs/RELIABILITY.md.

Not repeated here (already in test_export_crash.py / test_resave.py / test_gc*.py): EIO from
fsync-shard, the exchange EINVAL fallback, ENOSPC on a small tmpfs and RLIMIT_FSIZE for export, a
read-only filesystem and a second writer for export, Ctrl-C during export, a symlinked destination.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import crash_harness as H
from tests.support import (MANIFEST, clean_env, drop_dac_caps, run_ckptctl, wait_stopped, write_config,
                           write_sharded, write_single)

pytestmark = pytest.mark.slow

FAST = ["export-sharded-to-single", "export-single-to-sharded", "export-new-destination", "export-two-rename",
        "resave-dtype", "resave-repair", "resave-two-rename"]


@pytest.fixture(scope="module")
def zygote():
    z = H.ZygoteRunner()
    yield z
    z.close()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, zygote):
    cache: dict[str, H.Prepared] = {}
    root = tmp_path_factory.mktemp("crash")

    def get(name: str) -> H.Prepared:
        if name not in cache:
            cache[name] = H.Prepared(H.SCENARIOS[name], root / name, zygote)
        return cache[name]

    return get


def _expected(point: str) -> str:
    if point in H.PUBLISHED_POINTS:
        return "new"
    return "window" if point == "two-rename-between" else "old"


def _show(o: H.Outcome) -> str:
    return json.dumps(o.to_dict(), indent=1, default=str)[:3000]


# ---------------------------------------------------------------------------------------------
# SIGKILL at every named phase boundary (I1, I2, I4 via gc-tmp, I8)

NAMED = [pytest.param(s, p, id=f"{s}@{p}") for s in FAST for p in H.SCENARIOS[s].points]


@pytest.mark.parametrize("scenario,point", NAMED)
def test_kill_at_every_named_point(prepared, zygote, tmp_path, scenario, point):
    prep = prepared(scenario)
    o = H.run_trial(prep, H.Fault("point", point), tmp_path / "t", zygote, recovery="gc")
    assert o.killed and not o.violations, _show(o)
    assert o.after_kill == _expected(point) or (prep.old_absent and o.after_kill == "old"), _show(o)
    assert o.after_recovery in ("old", "new") and o.leaked_after_gc == 0 and o.rerun_identical
    if point not in ("stage-create",):
        assert o.staging_left == 1 and o.gc_removed == 1  # the dead writer's one directory, and only it


# the next run cleans up by itself (startup recovery, K23), no gc-tmp first
RERUN = [pytest.param(s, p, id=f"{s}@{p}") for s, p in [
    ("export-sharded-to-single", "write-data"), ("export-sharded-to-single", "sealed"),
    ("export-sharded-to-single", "exchange"), ("export-sharded-to-single", "after-publish"),
    ("export-new-destination", "rename-noreplace"), ("export-new-destination", "published"),
    ("export-two-rename", "published"), ("resave-dtype", "write-chunk"), ("resave-repair", "index"),
    ("resave-repair", "published"), ("resave-two-rename", "sealed")]]


@pytest.mark.parametrize("scenario,point", RERUN)
def test_rerun_after_a_kill_recovers_by_itself(prepared, zygote, tmp_path, scenario, point):
    o = H.run_trial(prepared(scenario), H.Fault("point", point), tmp_path / "t", zygote, recovery="rerun")
    assert o.killed and not o.violations, _show(o)
    assert o.after_recovery == "new" and o.rerun_identical and o.gc_removed == 0


def test_export_retry_in_the_two_rename_window_keeps_the_destinations_other_files(prepared, zygote, tmp_path):
    o = H.run_trial(prepared("export-two-rename"), H.Fault("point", "two-rename-between"), tmp_path / "t", zygote,
                    recovery="rerun")
    assert o.after_kill == "window"
    assert not o.violations, _show(o)


def test_resave_retry_in_the_two_rename_window_recovers(prepared, zygote, tmp_path):
    o = H.run_trial(prepared("resave-two-rename"), H.Fault("point", "two-rename-between"), tmp_path / "t", zygote,
                    recovery="rerun")
    assert o.after_kill == "window"
    assert not o.violations, _show(o)


@pytest.mark.parametrize("scenario,point", [("export-sharded-to-single", "write-data"),
                                            ("resave-dtype", "published")])
def test_a_fresh_interpreter_behaves_like_the_forked_one(prepared, tmp_path, scenario, point):
    o = H.run_trial(prepared(scenario), H.Fault("point", point), tmp_path / "t", H.ExecRunner())
    assert o.killed and not o.violations and o.after_kill == _expected(point), _show(o)


def test_plain_retry_of_a_new_destination_export_after_its_publish_is_refused(prepared, zygote, tmp_path):
    """I8 for an export without --overwrite: once the first attempt got past its publish, the
    same command again is refused (exit 2, the destination exists) and changes nothing; the
    destination is already byte-identical to a clean run."""
    prep = prepared("export-new-destination")
    p = prep.instantiate(tmp_path / "t")
    argv = prep.scn.argv(p.src, p.dst)
    assert zygote.run(argv, env={"CKPTCTL_KILL_AT": "published"}).rc == -signal.SIGKILL
    r = zygote.run(argv)
    assert r.rc == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
    assert H.snapshot(p.dst) == prep.new_snapshot


# ---------------------------------------------------------------------------------------------
# SIGKILL at random moments while data is written


@pytest.mark.parametrize("scenario", ["big-export-bf16", "big-resave-bf16", "big-resave-reshard"])
def test_kill_at_random_moments(prepared, zygote, tmp_path, scenario):
    prep = prepared(scenario)
    rng = random.Random(f"fast-{scenario}")
    outcomes: list[H.Outcome] = []
    # at least 3 trials, and on until one was really killed: a delay drawn near the end of a
    # clean run's span lets the run complete, more often on a busy machine (at most 8 trials)
    while len(outcomes) < 3 or (not any(o.killed for o in outcomes) and len(outcomes) < 8):
        i = len(outcomes)
        outcomes.append(H.run_trial(prep, H.random_fault(rng, prep), tmp_path / f"t{i}", zygote, poll=(i == 0)))
    for o in outcomes:
        assert not o.violations, _show(o)
        assert o.after_kill in ("old", "new") and o.after_recovery in ("old", "new") and o.rerun_identical
    assert any(o.killed for o in outcomes), [_show(o) for o in outcomes]


# ---------------------------------------------------------------------------------------------
# A reader polling the destination during publishes (K19)


def _alternating_publishes(tmp_path: Path, zygote, n: int, env: dict | None = None):
    a_src, b_src = tmp_path / "a", tmp_path / "b"
    write_sharded(a_src, H.model_state(1), max_shard_size=20_000)  # 3 shards + index
    write_single(b_src, H.model_state(2))  # one file
    for d in (a_src, b_src):
        write_config(d)
    ws = tmp_path / "ws"
    ws.mkdir()
    dst = ws / "ckpt"
    assert zygote.run(["export", a_src, dst, "--max-shard-size", "20KB"]).rc == 0
    (dst / "README.md").write_text("card\n")
    versions = {"old": H.dir_signature(dst)}
    assert zygote.run(["export", b_src, dst, "--overwrite"]).rc == 0
    versions["new"] = H.dir_signature(dst)
    assert versions["old"] != versions["new"] and not any(v.startswith("error") for v in versions["old"] + versions["new"])
    poller = H.Poller(dst, versions, absent_ok=bool(env))
    with poller:
        time.sleep(0.05)
        for i in range(n):
            src, extra = (a_src, ["--max-shard-size", "20KB"]) if i % 2 == 0 else (b_src, [])
            r = zygote.run(["export", src, dst, "--overwrite", *extra], env=env)
            assert r.rc == 0, r.stderr
            time.sleep(0.01)
    assert H.our_staging(ws) == []
    return poller.stats


def test_a_reader_never_sees_a_partial_destination_during_publishes(tmp_path, zygote):
    stats = _alternating_publishes(tmp_path, zygote, 16)
    assert not stats.violations, stats.violations[:5]
    # it really read, and saw both versions
    assert stats.observations >= 50 and stats.old > 0 and stats.new > 0, stats
    assert stats.absent == 0


# ---------------------------------------------------------------------------------------------
# The harness can fail: each check rejects a broken state


def test_the_harness_checks_reject_broken_states(prepared, zygote, tmp_path):
    prep = prepared("export-single-to-sharded")
    p = prep.instantiate(tmp_path / "t")
    assert H.classify(p.dst, prep) == "old" and H.check_marker(p.dst) == []
    # a mix: one new shard beside the old single file
    ref = prep.instantiate(tmp_path / "r")
    assert zygote.run(prep.scn.argv(ref.src, ref.dst)).rc == 0
    shutil.copy(ref.dst / "model-00001-of-00003.safetensors", p.dst)
    assert H.classify(p.dst, prep) == "mixed"
    assert any("glob loader" in v for v in H.check_version(p.dst, prep.old_tensors))
    assert any("manifest does not list" in v for v in H.check_marker(p.dst))
    # a manifest that lies about a size
    doc = json.loads((ref.dst / MANIFEST).read_text())
    doc["files"]["model.safetensors.index.json"]["size"] += 1
    (ref.dst / MANIFEST).write_text(json.dumps(doc))
    assert any("manifest size" in v for v in H.check_marker(ref.dst))
    # a leftover nobody can attribute
    stray = p.ws / "_tmp_ckpt.18ecc906440da92e-4404158d"
    (stray / "data").mkdir(parents=True)
    assert H.attributable(stray) is not None


def test_the_poller_catches_a_delete_then_write_publisher(tmp_path):
    """huggingface_hub's save_torch_state_dict removes the old files before writing the new ones;
    the poller must see that window."""
    from huggingface_hub import save_torch_state_dict

    ws = tmp_path / "ws"
    dst = ws / "ckpt"
    write_sharded(dst, H.model_state(1), max_shard_size=20_000)
    versions = {"old": H.dir_signature(dst)}
    other = tmp_path / "b"
    write_single(other, H.model_state(2))
    versions["new"] = H.dir_signature(other)
    poller = H.Poller(dst, versions, path_reads=False)
    with poller:
        for i in range(30):
            save_torch_state_dict(H.model_state(1 if i % 2 else 2), dst, max_shard_size=20_000 if i % 2 else 10 ** 9)
            if poller.stats.violations:
                break
    assert poller.stats.violations


# ---------------------------------------------------------------------------------------------
# Fault injection on real filesystems


@pytest.fixture
def mount_tmpfs():
    mounted: list[Path] = []

    def mount(where: Path, size: str = "16m") -> Path:
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(where)
        return where

    yield mount
    for m in reversed(mounted):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


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
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - 40_000))  # room for less than the new data
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
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))

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
