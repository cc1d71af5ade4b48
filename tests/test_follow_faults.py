"""``export --follow`` under faults, each interleaving held by a fault point (``CKPTCTL_STOP_AT``,
``CKPTCTL_KILL_AT``), never by a sleep: a save deleted or saved again mid-export (nothing
published, recorded lost, following goes on); the follower SIGKILLed at every step and restarted
(nothing lost, nothing exported twice, nothing left that gc-tmp cannot attribute); SIGTERM
mid-export; two followers on one DST_ROOT; retention that touches only the follower's own
exports; a failing --on-publish."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.follow_helpers import (assert_same_as_plain, leftovers, named, parse_events, records, run_follow,
                                  start_follow)
from tests.support.cli import communicate, process_state, wait_stopped
from tests.test_follow_dcp import Loop


def _held(run: Path, dst: Path, point: str, *extra: object):
    """A --once follower stopped at ``point`` (SIGSTOP): the caller changes the world, then
    :func:`_resume` lets it go on."""
    proc = start_follow(run, dst, *extra, env={"CKPTCTL_STOP_AT": point})
    wait_stopped(proc.pid)
    return proc


def _resume(proc, sig: int | None = None) -> tuple[int, list, str]:
    """Let the held follower go on (after ``sig``, if given) to its end; each later stop at the
    same point (the next save's export) is let go too."""
    if sig is not None:
        os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if process_state(proc.pid) == "T":
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.005)
    out, err = communicate(proc, 10)
    return proc.returncode, parse_events(out), err


@pytest.mark.parametrize("change", ["deleted", "saved-again"])
def test_save_changed_mid_export_is_lost_and_following_goes_on(tmp_path: Path, change: str) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    loop.save(1)
    proc = _held(run, dst, "shards-written", "--from", "all")
    if change == "deleted":
        shutil.rmtree(run / "step-1")
    else:
        loop.save(1)  # the trainer saves the step again while it is exported
    loop.save(2)
    rc, events, err = _resume(proc)
    assert rc == 0, err
    assert named(events, "lost") == ["step-1"]
    if change == "deleted":
        assert named(events, "published") == ["step-2"]
        assert not (dst / "step-1").exists() and records(dst)["step-1"]["status"] == "lost"
    else:  # the new save of step 1 (complete once the trainer is done) is a save of its own
        assert named(events, "published") == ["step-1", "step-2"]
        assert_same_as_plain(dst / "step-1", run / "step-1", tmp_path)
    assert_same_as_plain(dst / "step-2", run / "step-2", tmp_path)
    assert leftovers(dst) == []
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "published") == [] and named(events, "lost") == [], err


KILL_POINTS = ["follow-exporting", "shards-written", "sealed", "published", "after-publish", "follow-published"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_restart_nothing_lost_nothing_twice(tmp_path: Path, point: str) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    for step in (1, 2):
        loop.save(step)
    hook_log = tmp_path / "hook.log"
    hook = f"{sys.executable} -c \"import sys; open({str(hook_log)!r}, 'a').write(sys.argv[1] + '\\n')\""
    rc, events, err = run_follow(run, dst, "--from", "all", "--on-publish", hook, env={"CKPTCTL_KILL_AT": point})
    assert rc == -signal.SIGKILL, err
    was_published = (dst / "step-1").exists()
    rc, events, err = run_follow(run, dst, "--on-publish", hook)
    assert rc == 0, err
    assert named(events, "exporting") == (["step-2"] if was_published else ["step-1", "step-2"])
    assert named(events, "recovered") == (["step-1"] if was_published and point != "follow-published" else [])
    recs = records(dst)
    assert {n: r["status"] for n, r in recs.items()} == {"step-1": "published", "step-2": "published"}
    for step in (1, 2):
        assert_same_as_plain(dst / f"step-{step}", run / f"step-{step}", tmp_path)
        assert recs[f"step-{step}"]["on_publish"]["exit_code"] == 0
    # the hook ran for each publish (a kill between the publish and its hook: at least once)
    assert sorted(set(hook_log.read_text().split())) == [str(dst / "step-1"), str(dst / "step-2")]
    assert leftovers(dst) == []
    rc, events, err = run_follow(run, dst)
    assert named(events, "exporting") == [], err


@pytest.mark.parametrize("point", ["follow-remove-staged", "follow-remove-moved"])
def test_sigkill_during_retention_then_restart(tmp_path: Path, point: str) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    loop.save(1)
    run_follow(run, dst, "--from", "all", "--keep-last", "1")
    loop.save(2)
    rc, events, err = run_follow(run, dst, "--keep-last", "1", env={"CKPTCTL_KILL_AT": point})
    assert rc == -signal.SIGKILL and named(events, "published") == ["step-2"], err
    rc, events, err = run_follow(run, dst, "--keep-last", "1")
    assert rc == 0 and named(events, "removed") == ["step-1"], err
    assert not (dst / "step-1").exists() and (dst / "step-2").is_dir()
    assert records(dst)["step-1"]["status"] == "removed"
    assert leftovers(dst) == []


def test_sigterm_mid_export_stops_cleanly_and_the_save_is_exported_next_time(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    Loop(run).save(1)
    proc = _held(run, dst, "shards-written", "--from", "all")
    rc, events, err = _resume(proc, signal.SIGTERM)
    assert rc == 0, err
    assert events[-1]["event"] == "stopped" and events[-1]["signal"] == "SIGTERM"
    assert not (dst / "step-1").exists() and "step-1" not in records(dst)
    assert leftovers(dst) == []
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "published") == ["step-1"], err
    assert_same_as_plain(dst / "step-1", run / "step-1", tmp_path)


def test_two_followers_on_one_dst_root_the_second_is_refused_naming_the_first(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    Loop(run).save(1)
    first = _held(run, dst, "follow-exporting", "--from", "all")
    rc, events, err = run_follow(run, dst)
    assert rc == 3, err
    assert f"pid {first.pid}" in err and "already followed" in err
    assert events[-1]["event"] == "error" and events[-1]["error"]["code"] == "lock_held"
    rc, events, err = _resume(first)
    assert rc == 0 and named(events, "published") == ["step-1"], err


def test_retention_removes_only_its_own_exports(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    dst.mkdir()
    (dst / "notes").mkdir()  # a teammate's folder
    (dst / "notes" / "eval.txt").write_text("keep me")
    (dst / "step-3").mkdir()  # a directory of the name a save will have, not the follower's
    for step in (1, 2, 3, 4, 5, 6):
        loop.save(step)
    rc, events, err = run_follow(run, dst, "--from", "all", "--keep-last", "2", "--keep-every", "4")
    assert rc == 0, err
    assert named(events, "refused") == ["step-3"]
    assert named(events, "published") == ["step-1", "step-2", "step-4", "step-5", "step-6"]
    assert sorted(named(events, "removed")) == ["step-1", "step-2"]
    assert sorted(p.name for p in dst.iterdir()) == [".ckptctl-follow", "notes", "step-3", "step-4", "step-5",
                                                     "step-6"]
    assert (dst / "notes" / "eval.txt").read_text() == "keep me"
    # an export replaced by someone else (the new directory may even get the freed inode number),
    # or one a user added a file to, is no longer exactly ours: released, never removed
    shutil.rmtree(dst / "step-5")
    (dst / "step-5").mkdir()
    (dst / "step-6" / "eval_results.json").write_text("{}")
    loop.save(7)
    loop.save(8)
    rc, events, err = run_follow(run, dst, "--keep-last", "2", "--keep-every", "4")
    assert rc == 0, err
    assert named(events, "released") == ["step-5", "step-6"] and named(events, "removed") == []
    assert (dst / "step-6" / "eval_results.json").exists()
    assert named(events, "refused") == []  # step-3 is still blocked: said once
    assert (dst / "step-5").is_dir() and (dst / "step-4").is_dir() and (dst / "step-8").is_dir()
    assert records(dst)["step-3"]["status"] == "blocked"
    (dst / "step-3").rename(tmp_path / "step-3-moved-aside")
    rc, events, err = run_follow(run, dst, "--keep-last", "2", "--keep-every", "4")
    assert rc == 0 and named(events, "published") == ["step-3"], err
    assert named(events, "removed") == ["step-3"]  # older than the newest, kept by no rule


def test_failing_on_publish_is_recorded_and_following_goes_on(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    for step in (1, 2):
        loop.save(step)
    rc, events, err = run_follow(run, dst, "--from", "all", "--on-publish", f"{sys.executable} -c 'raise SystemExit(7)'")
    assert rc == 0, err
    assert named(events, "published") == ["step-1", "step-2"]
    assert [e["exit_code"] for e in events if e["event"] == "hook"] == [7, 7]
    assert records(dst)["step-2"]["on_publish"]["exit_code"] == 7
    rc, events, err = run_follow(run, dst, "--on-publish", "/nonexistent/upload")
    assert rc == 0 and named(events, "hook") == [], err  # a hook runs once per publish, not per run


def test_verify_records_the_outcome(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    Loop(run).save(1)
    rc, events, err = run_follow(run, dst, "--from", "all", "--verify")
    assert rc == 0, err
    assert [e["verified"] for e in events if e["event"] == "published"] == [True]
    assert records(dst)["step-1"]["verified"] is True


def test_disk_full_stops_the_follower_and_the_save_is_exported_once_there_is_room(tmp_path: Path,
                                                                                  mount_tmpfs) -> None:
    import subprocess

    import torch
    import torch.distributed.checkpoint as dcp
    import warnings

    run, dst = tmp_path / "run", mount_tmpfs(tmp_path / "hf", size="1m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(1024, 512)}, checkpoint_id=str(run / "step-1"))  # 2 MB
    rc, events, err = run_follow(run, dst, "--from", "all")
    assert rc == 3 and "not enough free space" in err, err
    assert events[-1]["event"] == "error" and events[-1]["error"]["code"] == "disk_full"
    assert "step-1" not in records(dst) and leftovers(dst) == []
    if subprocess.run(["mount", "-o", "remount,size=16m", str(dst)], capture_output=True).returncode != 0:
        pytest.skip("cannot grow the tmpfs here")
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "published") == ["step-1"], err
    assert_same_as_plain(dst / "step-1", run / "step-1", tmp_path)


def test_exit_when_idle(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    Loop(run).save(1)
    proc = start_follow(run, dst, "--from", "all", "--exit-when-idle", "0", once=False)
    out, err = communicate(proc, 300)
    events = parse_events(out)
    assert proc.returncode == 0, err
    assert named(events, "published") == ["step-1"] and events[-1]["event"] == "idle"


def test_an_export_replaced_between_retentions_check_and_its_rename_is_put_back(tmp_path: Path) -> None:
    """Held after retention's look and before its rename, the export is swapped for a user's
    directory: what was moved is checked, found not to be ours, and put back untouched."""
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    for step in (1, 2):
        loop.save(step)
    rc, events, err = run_follow(run, dst, "--from", "all")
    assert rc == 0 and named(events, "published") == ["step-1", "step-2"], err
    proc = _held(run, dst, "follow-remove-staged", "--keep-last", "1")
    os.rename(dst / "step-1", tmp_path / "aside")
    shutil.copytree(tmp_path / "aside", dst / "step-1")  # the user's directory, with the same files
    (dst / "step-1" / "mine.txt").write_text("keep me")
    rc, events, err = _resume(proc)
    assert rc == 0, err
    assert named(events, "released") == ["step-1"] and named(events, "removed") == []
    assert (dst / "step-1" / "mine.txt").read_text() == "keep me"
    assert records(dst)["step-1"]["status"] == "released" and leftovers(dst) == []
