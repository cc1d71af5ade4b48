"""The staging state function (``staging.inspect``) and the actions taken on it, on real staging
directories built on disk, with real writer processes (alive holding the lock, then SIGKILLed)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptctl import staging
from ckptctl.errors import LockHeldError, OperationalError
from ckptctl.publish import Stage
from ckptctl.staging import State
from tests.test_gc import dead_pid  # noqa: F401 (fixture)

# A real writer: creates its staging directory the way every export does (lock, owner record,
# data/), says so, and waits (lock held) until stdin closes or it is killed.
WRITER = """
import sys
from pathlib import Path
from ckptctl.publish import Stage
stage = Stage(Path(sys.argv[1]), fsync=False, command="test writer")
stage.create()
print(stage.dir, flush=True)
sys.stdin.read()
"""

# A writer killed between taking its lock and writing its owner record: an empty stub, lock held.
STARTING_WRITER = """
import os, sys
from pathlib import Path
from ckptctl import staging
d = Path(sys.argv[1])
os.mkdir(d)
lock = staging.acquire(d)
print(d, flush=True)
sys.stdin.read()
"""


def _spawn(script: str, arg: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env = {k: v for k, v in env.items() if not k.startswith("CKPTCTL_")}
    p = subprocess.Popen([sys.executable, "-c", script, str(arg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    line = p.stdout.readline().strip()
    assert line, "the writer died before it was ready"
    return p, Path(line)


def _kill(p: subprocess.Popen) -> None:
    p.kill()
    p.wait(timeout=30)


def make(parent: Path, dest: str = "ckpt", *, owner: dict | None = None, lock: bool = True, ready: bool = False,
         old: bool = False, data: bool = True) -> Path:
    """A staging directory as a writer leaves it at some phase; ``owner`` overrides record fields
    (None: no owner record)."""
    parent.mkdir(parents=True, exist_ok=True)
    d = parent / staging.staging_name(dest)
    d.mkdir()
    if lock:
        (d / staging.LOCK).touch()
    if owner is not None:
        record = staging.owner_record(parent / dest, "test")
        record.update(owner)
        (d / staging.OWNER).write_text(json.dumps(record))
    if data:
        (d / staging.DATA).mkdir()
        (d / staging.DATA / "model.safetensors").write_bytes(b"new version")
    if ready:
        (d / staging.READY).write_text("ready\n")
    if old:
        (d / staging.OLD).mkdir()
        (d / staging.OLD / "model.safetensors").write_bytes(b"old version")
    return d


@pytest.fixture
def dead(dead_pid):  # noqa: F811
    return {"pid": dead_pid[0], "start_time": dead_pid[1]}


# ---------------------------------------------------------------------------------------------
# every state


def test_not_ours_without_owner_record(tmp_path):
    d = make(tmp_path, owner=None)
    st = staging.inspect(d)
    assert st.state is State.NOT_OURS and st.owner is None and st.live.alive is False
    assert st.dest == tmp_path / "ckpt"


def test_owner_record_of_another_tool_or_behind_a_link_or_a_fifo_is_not_ours(tmp_path, dead):
    other = make(tmp_path / "a", owner={**dead, "tool": "miles"})
    assert staging.inspect(other).state is State.NOT_OURS
    real = make(tmp_path / "b", owner=dead)
    linked = make(tmp_path / "b", owner=None)
    (linked / staging.OWNER).symlink_to(real / staging.OWNER)  # a valid record, but through a link
    assert staging.read_owner(linked) is None and staging.inspect(linked).state is State.NOT_OURS
    fifo = make(tmp_path / "c", owner=None)
    os.mkfifo(fifo / staging.OWNER)  # opening it for reading would block without O_NONBLOCK
    assert staging.read_owner(fifo) is None and staging.inspect(fifo).state is State.NOT_OURS
    big = make(tmp_path / "d", owner=None)
    (big / staging.OWNER).write_text(json.dumps({"tool": "ckptctl", "pad": "x" * (1 << 16)}))  # > 64 KiB
    assert staging.read_owner(big) is None


@pytest.mark.parametrize("entries", [(), ("lock",), ("lock", "owner.json")])
def test_stub_is_an_empty_directory_or_empty_lock_and_owner(tmp_path, entries):
    d = tmp_path / staging.staging_name("ckpt")
    d.mkdir()
    for n in entries:
        (d / n).touch()
    st = staging.inspect(d)
    assert st.state is State.STUB and st.owner is None and not st.live.alive
    (d / "x").touch()  # anything else inside: not provably ours
    assert staging.inspect(d).state is State.NOT_OURS


def test_live_writer_process_is_writing_then_abandoned_once_killed(tmp_path):
    p, d = _spawn(WRITER, tmp_path / "ckpt")
    try:
        st = staging.inspect(d)
        assert st.state is State.WRITING and st.live.reason == "lock held"
        assert st.owner["pid"] == p.pid and st.owner["command"] == "test writer"
        assert staging.probe(d) is True and staging.acquire(d) is None
    finally:
        _kill(p)
    st = staging.inspect(d)
    assert st.state is State.ABANDONED and st.live.reason == f"pid {p.pid} is gone"
    assert staging.probe(d) is False


def test_live_writer_keeps_its_directory_through_recovery_and_competitors(tmp_path):
    p, d = _spawn(WRITER, tmp_path / "ckpt")
    try:
        before = sorted(os.listdir(d))
        assert staging.recover_destination(tmp_path / "ckpt") == []
        assert sorted(os.listdir(d)) == before
    finally:
        _kill(p)
    assert staging.inspect(d).state is State.ABANDONED
    assert staging.recover_destination(tmp_path / "ckpt") == [] and not d.exists()  # same host: removed


def test_starting_writer_holding_the_lock_of_a_stub_is_writing(tmp_path):
    p, d = _spawn(STARTING_WRITER, tmp_path / staging.staging_name("ckpt"))
    try:
        st = staging.inspect(d)
        assert st.state is State.WRITING and st.owner is None
        assert st.live.reason == "lock held (owner record not written yet)"
    finally:
        _kill(p)
    assert staging.inspect(d).state is State.STUB


def test_our_own_pid_with_a_free_lock_is_writing(tmp_path):
    d = make(tmp_path, owner={})  # this process: alive, though nobody holds the lock
    st = staging.inspect(d)
    assert st.state is State.WRITING and "still running" in st.live.reason


def test_not_ours_with_a_held_lock_stays_not_ours_but_alive(tmp_path):
    p, d = _spawn(STARTING_WRITER, tmp_path / staging.staging_name("ckpt"))
    try:
        (d / "state.bin").write_bytes(b"x")  # no longer an empty stub
        st = staging.inspect(d)
        assert st.state is State.NOT_OURS and st.live.alive
    finally:
        _kill(p)


def test_abandoned_and_sealed(tmp_path, dead):
    assert staging.inspect(make(tmp_path, owner=dead)).state is State.ABANDONED
    sealed = make(tmp_path, owner=dead, ready=True)
    assert staging.inspect(sealed).state is State.SEALED
    (sealed / staging.READY).unlink()
    (sealed / staging.READY).symlink_to(sealed / staging.DATA / "model.safetensors")  # a link is not a seal
    assert staging.inspect(sealed).state is State.ABANDONED


def test_half_published_forward_back_and_leftover(tmp_path, dead):
    fwd = make(tmp_path / "f", owner=dead, ready=True, old=True)
    st = staging.inspect(fwd)
    assert st.state is State.HALF_PUBLISHED_FORWARD and st.state.recovery == "roll-forward"
    back = make(tmp_path / "b", owner=dead, ready=False, old=True)
    assert staging.inspect(back).state is State.HALF_PUBLISHED_BACK
    # old/ without data/: data/ became the destination, the publish completed. old/ is garbage even
    # when the destination is missing now (another writer is between its two renames): rolling it
    # back used to put a version two publishes old in place and let the real one be deleted.
    nodata = make(tmp_path / "n", owner=dead, ready=True, old=True, data=False)
    assert staging.inspect(nodata).state is State.PUBLISHED_LEFTOVER
    unsealed = make(tmp_path / "u", owner=dead, ready=False, old=True, data=False)
    assert staging.inspect(unsealed).state is State.PUBLISHED_LEFTOVER
    left = make(tmp_path / "l", owner=dead, ready=True, old=True, data=False)
    (tmp_path / "l" / "ckpt").mkdir()  # the second rename happened
    assert staging.inspect(left).state is State.PUBLISHED_LEFTOVER and staging.inspect(left).state.recovery is None
    # old/ and data/ both there and something at the destination: it appeared between the renames
    conflict = make(tmp_path / "c", owner=dead, ready=True, old=True)
    (tmp_path / "c" / "ckpt").mkdir()
    st = staging.inspect(conflict)
    assert st.state is State.CONFLICT and st.state.protected and st.state.recovery is None
    for s in State:
        assert s.protected == (s in (State.HALF_PUBLISHED_FORWARD, State.HALF_PUBLISHED_BACK, State.CONFLICT))


def test_data_behind_a_link_is_never_rolled_forward(tmp_path, dead):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret").write_text("s")
    d = make(tmp_path / "p", owner=dead, ready=True, old=True, data=False)
    (d / staging.DATA).symlink_to(elsewhere)
    st = staging.inspect(d)
    assert st.state is State.HALF_PUBLISHED_BACK
    with staging.acquire(d) as _:
        assert staging.recover(staging.inspect(d, locked=True)) == "rolled-back"
    dest = tmp_path / "p" / "ckpt"
    assert not dest.is_symlink() and (dest / "model.safetensors").read_bytes() == b"old version"
    assert (elsewhere / "secret").read_text() == "s"


def test_other_host_is_dead_once_its_lock_is_free(tmp_path):
    d = make(tmp_path, owner={"host": "node-9.invalid", "pid": 1}, ready=True)
    st = staging.inspect(d)
    assert st.state is State.SEALED and st.live.reason == "lock free (owner on another host)"


def test_locked_inspection_ignores_the_callers_own_lock(tmp_path, dead):
    d = make(tmp_path, owner=dead, ready=True, old=True)
    with staging.acquire(d):
        assert staging.inspect(d).state is State.WRITING  # a probe sees the lock held
        st = staging.inspect(d, locked=True)
        assert st.state is State.HALF_PUBLISHED_FORWARD and not st.live.alive


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_lock_that_is_not_a_regular_file_is_nobodys_and_never_followed(tmp_path, dead, kind):
    """No writer's lock is a link, a FIFO or a directory (a writer creates a regular file and keeps
    it): such a lock is free, so a dead neighbour with one never blocks anyone (issue 15); the pid
    still speaks for a writer that is alive."""
    d = make(tmp_path, owner=dead, lock=False)
    target = tmp_path / "elsewhere.lock"
    target.touch()
    if kind == "symlink":
        (d / staging.LOCK).symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(d / staging.LOCK)  # never blocked on
    else:
        (d / staging.LOCK).mkdir()
    st = staging.inspect(d)
    assert st.state is State.ABANDONED and not st.live.alive and st.live.error is None
    with pytest.raises(staging.NotALock) as err:
        staging.acquire(d)
    assert err.value.errno == {"symlink": errno.ELOOP, "fifo": errno.EINVAL, "directory": errno.EISDIR}[kind]
    assert target.stat().st_size == 0 and not target.is_symlink()
    assert staging.recover_destination(tmp_path / "ckpt") == [] and (d / staging.DATA).is_dir()  # skipped, no raise


# ---------------------------------------------------------------------------------------------
# actions


def test_recover_rolls_forward_then_the_directory_goes(tmp_path, dead):
    d = make(tmp_path, owner=dead, ready=True, old=True)
    with staging.acquire(d):
        st = staging.inspect(d, locked=True)
        assert staging.recover(st) == "rolled-forward"
        assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == b"new version"
        assert staging.inspect(d, locked=True).state is State.PUBLISHED_LEFTOVER
        assert staging.recover(staging.inspect(d, locked=True)) is None
        staging.remove_staging(d)
    assert not d.exists() and os.listdir(tmp_path) == ["ckpt"]


def test_recover_destination_rolls_back_and_removes_a_dead_writers_directory(tmp_path, dead):
    d = make(tmp_path, owner=dead, old=True)
    done = staging.recover_destination(tmp_path / "ckpt")
    assert done == [f"{d.name}: rolled-back"] and not d.exists()
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == b"old version"


def test_recover_destination_leaves_another_hosts_directory_after_rolling(tmp_path):
    d = make(tmp_path, owner={"host": "node-9.invalid", "pid": 1}, ready=True, old=True)
    assert staging.recover_destination(tmp_path / "ckpt") == [f"{d.name}: rolled-forward"]
    assert d.exists() and staging.inspect(d).state is State.PUBLISHED_LEFTOVER  # gc-tmp's, by age


def test_removal_refuses_a_half_published_directory(tmp_path, dead):
    for ready in (True, False):
        d = make(tmp_path / str(ready), owner=dead, ready=ready, old=True)
        with pytest.raises(OSError) as err:
            staging.remove_staging(d)
        assert err.value.errno == errno.EEXIST and "only copy" in err.value.strerror
        assert (d / staging.OLD / "model.safetensors").read_bytes() == b"old version"
        assert (d / staging.OWNER).exists()


def test_writer_cleanup_never_removes_the_only_copy_of_the_destination(tmp_path):
    """The writer's own finish() after a two-rename whose undo failed: before the state check it
    removed old/, the only copy of the destination. Now the directory stays for recovery."""
    dest = tmp_path / "ckpt"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(b"old version")
    stage = Stage(dest, fsync=False)
    stage.create()
    d = stage.dir
    os.rename(dest, d / staging.OLD)  # the first rename of the two-rename happened, the rest did not
    stage.finish()
    assert (d / staging.OLD / "model.safetensors").read_bytes() == b"old version"
    st = staging.inspect(d)  # this process is the writer and still runs: nobody may touch it yet
    assert st.state is State.WRITING
    with pytest.raises(LockHeldError) as err:  # a second writer now is refused, not told "no destination"
        staging.recover_destination(dest)
    assert err.value.exit_code == 3 and d.name in err.value.message and not dest.exists()
    with staging.acquire(d):
        assert staging.phase(d) is State.HALF_PUBLISHED_BACK
        assert staging.recover(staging.inspect(d, locked=True)) is None  # alive (our pid): never acted on
        staging.roll(d, dest, forward=False, fsync=False)
        staging.remove_staging(d)
    assert (dest / "model.safetensors").read_bytes() == b"old version" and os.listdir(tmp_path) == ["ckpt"]


def test_a_killed_writer_in_the_two_rename_window_is_rolled_forward_by_the_next_run(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src, dest = tmp_path / "src", tmp_path / "out" / "ckpt"
    src.mkdir()
    dest.mkdir(parents=True)
    save_file({"w": np.arange(16, dtype=np.float32)}, str(src / "model.safetensors"))
    save_file({"w": np.zeros(16, dtype=np.float32)}, str(dest / "model.safetensors"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTCTL_")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               CKPTCTL_FAIL_AT="exchange:EINVAL", CKPTCTL_KILL_AT="two-rename-between")
    p = subprocess.run([sys.executable, "-m", "ckptctl", "export", str(src), str(dest), "--overwrite"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    [d] = staging.siblings(dest.parent, "ckpt")
    assert not dest.exists() and staging.inspect(d).state is State.HALF_PUBLISHED_FORWARD
    assert staging.recover_destination(dest) == [f"{d.name}: rolled-forward"]
    assert not d.exists() and os.listdir(dest.parent) == ["ckpt"]
    np.testing.assert_array_equal(load_file(str(dest / "model.safetensors"))["w"], np.arange(16, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# the journal, identities, conflicts (issue 18)


def _journaled(parent: Path, dead: dict) -> tuple[Path, Path]:
    """A dead writer's staging directory between its two renames, as ``Stage`` leaves it: sealed
    (``ready`` holding the journal of the real directories), then ``dest -> old/``. Returns
    (dir, dest)."""
    dest = parent / "ckpt"
    dest.mkdir(parents=True)
    (dest / "model.safetensors").write_bytes(b"old version")
    d = make(parent, owner=dead)
    staging.write_small(d / staging.READY, json.dumps(staging.journal_record(dest, d / staging.DATA)).encode(),
                        fsync=False)
    os.rename(dest, d / staging.OLD)
    return d, dest


def test_journal_records_what_old_and_data_are(tmp_path, dead):
    d, dest = _journaled(tmp_path, dead)
    j = staging.read_journal(d)
    assert j["dest"] == "ckpt" and j["tool"] == "ckptctl"
    assert j["previous"]["ino"] == os.lstat(d / staging.OLD).st_ino
    assert j["new"]["ino"] == os.lstat(d / staging.DATA).st_ino
    assert staging.inspect(d).state is State.HALF_PUBLISHED_FORWARD
    (d / staging.READY).write_text("ready\n")  # an older ckptctl's seal: no journal, the same rules minus identity
    assert staging.read_journal(d) is None and staging.inspect(d).state is State.HALF_PUBLISHED_FORWARD


def test_an_old_dir_that_is_not_the_journaled_destination_is_a_conflict_never_acted_on(tmp_path, dead):
    d, dest = _journaled(tmp_path, dead)
    os.rename(d / staging.OLD, tmp_path / "moved-away")
    (d / staging.OLD).mkdir()  # some other directory now sits at old/
    (d / staging.OLD / "model.safetensors").write_bytes(b"who knows")
    st = staging.inspect(d)
    assert st.state is State.CONFLICT and st.state.protected
    with pytest.raises(OSError) as err:
        staging.remove_staging(d)
    assert err.value.errno == errno.EEXIST
    with pytest.raises(OperationalError) as err:
        staging.recover_destination(dest)
    assert err.value.exit_code == 3 and "nothing was deleted" in err.value.message
    assert (d / staging.OLD / "model.safetensors").read_bytes() == b"who knows" and not dest.exists()
    assert (d / staging.DATA / "model.safetensors").read_bytes() == b"new version"


def test_data_that_is_not_the_journaled_directory_is_rolled_back_not_forward(tmp_path, dead):
    d, dest = _journaled(tmp_path, dead)
    os.rename(d / staging.DATA, tmp_path / "elsewhere")
    (d / staging.DATA).mkdir()  # a different directory than the one that was sealed
    assert staging.inspect(d).state is State.HALF_PUBLISHED_BACK
    assert staging.recover_destination(dest) == [f"{d.name}: rolled-back"] and not d.exists()
    assert (dest / "model.safetensors").read_bytes() == b"old version"


def test_the_destination_appearing_between_the_renames_is_a_conflict(tmp_path, dead):
    d, dest = _journaled(tmp_path, dead)
    dest.mkdir()
    (dest / "theirs").write_text("t")
    assert staging.inspect(d).state is State.CONFLICT
    with pytest.raises(OperationalError):
        staging.recover_destination(dest)
    assert os.listdir(dest) == ["theirs"] and (d / staging.OLD).is_dir() and (d / staging.DATA).is_dir()
    os.rename(dest, tmp_path / "theirs")  # moved aside: now it can finish
    assert staging.recover_destination(dest) == [f"{d.name}: rolled-forward"] and not d.exists()
    assert (dest / "model.safetensors").read_bytes() == b"new version"


def test_each_directory_is_judged_on_its_own_facts_not_by_order(tmp_path, dead):
    """A completed publish's leftover (old/ only) sorted first, and a writer killed between its
    renames: the leftover is never rolled back; the killed writer's version is rolled forward."""
    parent = tmp_path / "p"
    stale = make(parent, owner=dead, ready=True, old=True, data=False)  # earlier stamp: first in any sort
    (stale / staging.OLD / "model.safetensors").write_bytes(b"two publishes old")
    d, dest = _journaled(parent, dead)
    assert sorted([stale, d]) == [stale, d]
    assert staging.inspect(stale).state is State.PUBLISHED_LEFTOVER
    assert staging.recover_destination(dest) == [f"{d.name}: rolled-forward"]
    assert (dest / "model.safetensors").read_bytes() == b"new version"
    assert os.listdir(parent) == ["ckpt"]


def test_checked_rename_counts_a_rename_that_was_done(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    staging.rename(a, b)
    assert b.is_dir() and not a.exists()
    assert staging.moved(a, b) and not staging.moved(b, a)
    with pytest.raises(FileNotFoundError):
        staging.rename(a, tmp_path / "c")  # neither done nor doable: raised
