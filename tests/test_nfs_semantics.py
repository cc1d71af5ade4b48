"""The exchange-less publish on NFS and FUSE semantics (issue 18), on a real FUSE mount.

Every test mounts ``tests/fusefs`` in its own process: ``renameat2`` flags refused with EINVAL (as
the NFS client does), files unlinked while open silly-renamed to ``.nfsXXXX`` (or hidden by libfuse),
dentries and attributes cached for a minute, renames whose reply is lost on demand. ckptctl runs
as real processes (``python -m ckptctl``) on real safetensors files; readers hold real descriptors.

After every command the invariant is checked (:func:`assert_invariant`): some complete version
(the newest published, or the one being published) is at the destination, or recoverable from
exactly one sealed staging directory; and no version that ever was published or staged was
deleted while it was the last copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ckptctl import staging
from tests.support import popen_ckptctl, run_ckptctl, staging_dirs, wait_stopped
from tests.fusefs import MountRefused, mounted

DEST = "ckpt"


# ---------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture
def mount(tmp_path):
    """``mount(**switches)`` -> a mounted :class:`tests.fusefs.FuseMount`, unmounted after the test."""
    with contextlib.ExitStack() as stack:
        def make(**opts):
            try:
                return stack.enter_context(mounted(tmp_path / "fuse", **opts))
            except MountRefused as exc:
                pytest.skip(str(exc))

        yield make


@pytest.fixture
def nfs(mount):
    """NFS semantics: no renameat2 flags, silly rename, a minute of dentry/attribute cache."""
    return mount(refuse_rename_flags=True, silly="nfs", cache=60)


def version(n: int) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 8), n, dtype=np.float32), "b": np.arange(16, dtype=np.float32) + n}


def sources(root: Path, *ns: int) -> dict[int, Path]:
    out = {}
    for n in ns:
        d = root / f"src{n}"
        d.mkdir(parents=True)
        save_file(version(n), str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({"model_type": "test", "version": n}))
        out[n] = d
    return out


def workspace(m, tmp_path: Path, *ns: int, first: bool = True) -> tuple[dict[int, Path], Path, Path]:
    """Sources of versions ``ns`` and ``<mount>/ws``; with ``first``, version ns[0] published at
    ``ws/ckpt``. Returns (sources, ws, dest)."""
    src = sources(tmp_path / "in", *ns)
    ws = m.mnt / "ws"
    ws.mkdir()
    dest = ws / DEST
    if first:
        p = run_ckptctl("export", src[ns[0]], dest)
        assert p.returncode == 0, p.stderr
    return src, ws, dest


@contextlib.contextmanager
def paused_in_window(src: Path, dest: Path):
    """``export SRC DEST --overwrite`` stopped (SIGSTOP) between its two renames; continued when
    the block ends. Yields the process (``communicate()`` it afterwards)."""
    w = popen_ckptctl("export", src, dest, "--overwrite", env={"CKPTCTL_STOP_AT": "two-rename-between"})
    try:
        wait_stopped(w.pid)
        yield w
    finally:
        os.kill(w.pid, signal.SIGCONT)


def which_version(d: Path) -> int | None:
    """The version a checkpoint directory holds completely (its tensors and config), else None."""
    try:
        tensors = load_file(str(d / "model.safetensors"))
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = config.get("version")
    want = version(n) if isinstance(n, int) else None
    if want is None or set(tensors) != set(want) or not all(np.array_equal(tensors[k], want[k]) for k in want):
        return None
    return n


def holding(ws: Path, name: str) -> list[Path]:
    """The staging directories in ``ws`` that hold ``name`` (e.g. ``old``)."""
    return [p for p in staging_dirs(ws) if (p / name).exists()]


def assert_invariant(ws: Path, published: int, staged: int | None = None) -> int:
    """Some complete version -- ``published`` (the newest published) or ``staged`` (the one being
    published) -- is at the destination, or (the destination missing) in exactly one sealed staging
    directory whose state rolls it there. Returns the version at (or recoverable to) the destination."""
    wanted = {published} | ({staged} if staged is not None else set())
    dest = ws / DEST
    if os.path.lexists(dest):
        got = which_version(dest)
        assert got in wanted, f"{dest} holds {got}, expected one of {sorted(wanted)}: {os.listdir(dest)}"
        return got
    rollable = []
    for d in staging_dirs(ws):
        st = staging.inspect(d)
        if st.state.half_published:
            src = d / (staging.DATA if st.state is staging.State.HALF_PUBLISHED_FORWARD else staging.OLD)
            rollable.append((d, which_version(src)))
    assert len(rollable) == 1, f"{dest} is missing and {len(rollable)} staging directories would roll it: {rollable}"
    assert rollable[0][1] in wanted, f"the staging directory would roll version {rollable[0][1]} to {dest}"
    return rollable[0][1]


def gc_tmp(ws: Path, *extra: str) -> tuple[int, dict]:
    p = run_ckptctl("gc-tmp", ws, "--min-age", "0", "--json", *extra)
    return p.returncode, json.loads(p.stdout)


# ---------------------------------------------------------------------------------------------
# the mount really has the semantics the tests rely on


def test_the_mount_refuses_rename_flags_silly_renames_and_caches_dentries(nfs):
    import ctypes

    a, b = nfs.mnt / "a", nfs.mnt / "b"
    a.mkdir()
    b.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.renameat2(-100, bytes(a), -100, bytes(b), 2) == -1 and ctypes.get_errno() == 22  # EINVAL
    f = a / "f"
    f.write_bytes(b"x")
    fd = os.open(f, os.O_RDONLY)
    os.unlink(f)
    [silly] = os.listdir(a)
    assert silly.startswith(".nfs")
    with pytest.raises(OSError) as err:
        os.rmdir(a)
    assert err.value.errno == 39  # ENOTEMPTY
    os.close(fd)
    assert os.listdir(a) == []
    os.lstat(b)  # cached now
    nfs.lose_reply(src="b", dst="moved")
    with pytest.raises(OSError) as err:
        os.rename(b, a / "moved")
    assert err.value.errno == 5  # EIO, but it was done:
    assert os.path.lexists(b) and "b" not in os.listdir(nfs.mnt) and os.listdir(a) == ["moved"]
    assert [e["fault"] for e in nfs.faults()] == ["rename-flags-refused", "silly-rename", "lost-reply"]


# ---------------------------------------------------------------------------------------------
# 1. a stale old/ (a completed publish whose cleanup NFS deferred) is never rolled back


@pytest.mark.parametrize("recovery", ["gc-tmp", "next-run"])
def test_stale_old_of_a_completed_publish_is_never_rolled_back(nfs, tmp_path, recovery):
    src, ws, dest = workspace(nfs, tmp_path, 1, 2, 3, 4)
    reader = os.open(dest / "model.safetensors", os.O_RDONLY)  # a reader still has v1's shard open
    try:
        p = run_ckptctl("export", src[2], dest, "--overwrite", "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["publish"] == "two-rename" and nfs.faults("rename-flags-refused")
        assert nfs.faults("silly-rename")
        [stale] = holding(ws, staging.OLD)  # the writer's cleanup could not remove old/ (.nfsXXXX inside)
        assert staging.DATA not in os.listdir(stale)
        assert staging.inspect(stale).state is staging.State.PUBLISHED_LEFTOVER
        assert_invariant(ws, published=2)

        # another writer dies between its two renames: the destination is missing
        p = run_ckptctl("export", src[3], dest, "--overwrite", env={"CKPTCTL_KILL_AT": "two-rename-between"})
        assert p.returncode == -signal.SIGKILL, p.stderr
        assert not os.path.lexists(dest) and len(holding(ws, staging.OLD)) == 2
        assert_invariant(ws, published=2, staged=3)
        assert staging.inspect(stale).state is staging.State.PUBLISHED_LEFTOVER  # still garbage, never rolled

        if recovery == "gc-tmp":  # candidates sorted by path: the stale directory comes first
            rc, doc = gc_tmp(ws)
            assert rc == 0, doc
            by_path = {Path(c["path"]).name: c for c in doc["candidates"]}
            assert by_path[stale.name]["decision"] == "deferred" and by_path[stale.name]["recovery"] is None
            [rolled] = [c for c in doc["candidates"] if c["recovery"]]
            assert rolled["recovery"] == "rolled-forward" and rolled["decision"] == "removed"
            assert assert_invariant(ws, published=3) == 3
        else:
            p = run_ckptctl("export", src[4], dest, "--overwrite", "--json")
            assert p.returncode == 0, p.stderr
            assert [r.split(": ")[1] for r in json.loads(p.stdout)["recovered"]] == ["rolled-forward"]
            assert assert_invariant(ws, published=4) == 4
        assert staging_dirs(ws) == [stale]  # the reader still holds v1's shard; nothing else is left
    finally:
        os.close(reader)
    rc, doc = gc_tmp(ws)
    assert rc == 0 and staging_dirs(ws) == [] and doc["removed"] == 1
    assert sorted(os.listdir(ws)) == [DEST]


# ---------------------------------------------------------------------------------------------
# 2. a lost reply on the first rename: decided from the directories, never from the cache


def test_lost_reply_on_the_first_rename_never_deletes_both_versions(nfs, tmp_path):
    src, ws, dest = workspace(nfs, tmp_path, 1, 2)
    nfs.lose_reply(src=DEST, dst=staging.OLD)  # dest -> staging/old is done, its reply lost (EIO)
    p = run_ckptctl("export", src[2], dest, "--overwrite", "--json")
    assert len(nfs.faults("lost-reply")) == 1
    assert p.returncode == 0, p.stderr  # the rename was done: the publish went on
    assert json.loads(p.stdout)["publish"] == "two-rename"
    assert assert_invariant(ws, published=2) == 2
    assert staging_dirs(ws) == [] and sorted(os.listdir(ws)) == [DEST]


def test_a_failed_second_rename_after_a_lost_first_reply_puts_the_previous_version_back(nfs, tmp_path):
    """The first rename's reply is lost and the second rename really fails (EIO, not done): the
    writer puts the previous version back (an uncached check sees old/ there), says nothing was
    published, and deletes nothing."""
    src, ws, dest = workspace(nfs, tmp_path, 1, 2)
    nfs.lose_reply(src=DEST, dst=staging.OLD)
    p = run_ckptctl("export", src[2], dest, "--overwrite",
                env={"CKPTCTL_FAIL_AT": "two-rename-between:EIO"})
    assert len(nfs.faults("lost-reply")) == 1
    assert p.returncode == 3 and "nothing was published" in p.stderr and "phase: publish" in p.stderr, p.stderr
    assert assert_invariant(ws, published=1) == 1
    assert staging_dirs(ws) == []


def test_when_the_previous_version_cannot_be_put_back_the_staging_directory_stays_for_recovery(nfs, tmp_path):
    """As above, and the rename that would put the previous version back fails too (the server
    is unreachable): the writer deletes nothing, says where both versions are, and leaves its
    sealed staging directory; gc-tmp rolls it forward once the storage answers."""
    src, ws, dest = workspace(nfs, tmp_path, 1, 2)
    nfs.lose_reply(src=DEST, dst=staging.OLD)
    nfs.fail_rename(src=staging.OLD, dst=DEST)
    p = run_ckptctl("export", src[2], dest, "--overwrite", env={"CKPTCTL_FAIL_AT": "two-rename-between:EIO"})
    assert [len(nfs.faults(k)) for k in ("lost-reply", "rename-failed")] == [1, 1]
    assert p.returncode == 3 and "nothing was deleted" in p.stderr and "gc-tmp" in p.stderr, p.stderr
    [d] = staging_dirs(ws)
    assert str(d / staging.OLD) in p.stderr and not os.path.lexists(dest)
    assert staging.inspect(d).state is staging.State.HALF_PUBLISHED_FORWARD
    assert assert_invariant(ws, published=1, staged=2) == 2
    rc, doc = gc_tmp(ws)
    assert rc == 0 and [c["recovery"] for c in doc["candidates"]] == ["rolled-forward"]
    assert assert_invariant(ws, published=2) == 2 and staging_dirs(ws) == []


# ---------------------------------------------------------------------------------------------
# 3. a directory appearing at the destination inside the window


def test_a_directory_appearing_in_the_window_is_a_conflict_that_deletes_nothing(nfs, tmp_path):
    src, ws, dest = workspace(nfs, tmp_path, 1, 2, 3)
    with paused_in_window(src[2], dest) as w:
        dest.mkdir()  # someone else's directory appears at the destination
        (dest / "theirs.txt").write_text("not ckptctl's")
    out, err = w.communicate(timeout=120)
    assert w.returncode == 3, err
    [d] = holding(ws, staging.OLD)
    assert "nothing was deleted" in err and str(d / staging.OLD) in err
    assert which_version(d / staging.OLD) == 1 and which_version(d / staging.DATA) == 2
    assert (dest / "theirs.txt").read_text() == "not ckptctl's" and os.listdir(dest) == ["theirs.txt"]
    assert staging.inspect(d).state is staging.State.CONFLICT

    rc, doc = gc_tmp(ws)  # kept, and reported as needing a human
    [c] = doc["candidates"]
    assert rc == 3 and c["decision"] == "kept" and c["error"].startswith("needs a human")
    p = run_ckptctl("export", src[3], dest, "--overwrite")  # the next run refuses until it is resolved
    assert p.returncode == 3 and "collided" in p.stderr, p.stderr
    assert which_version(d / staging.OLD) == 1 and which_version(d / staging.DATA) == 2

    os.rename(dest, ws / "theirs")  # the human moves the intruder aside
    assert staging.inspect(d).state is staging.State.HALF_PUBLISHED_FORWARD
    rc, doc = gc_tmp(ws)
    assert rc == 0 and [c["recovery"] for c in doc["candidates"]] == ["rolled-forward"]
    assert which_version(dest) == 2 and staging_dirs(ws) == [] and sorted(os.listdir(ws)) == [DEST, "theirs"]


# ---------------------------------------------------------------------------------------------
# 4. no staging directory left behind by a successful export, and stubs go


@pytest.mark.parametrize("silly", ["nfs", "libfuse"])
def test_an_export_leaves_no_staging_directory_and_gc_removes_stubs(mount, tmp_path, silly):
    m = mount(refuse_rename_flags=True, silly=silly, cache=60)
    src, ws, dest = workspace(m, tmp_path, 1, 2, first=False)
    for n, extra in ((1, ()), (2, ("--overwrite",))):
        p = run_ckptctl("export", src[n], dest, *extra)
        assert p.returncode == 0, p.stderr
        assert os.listdir(ws) == [DEST], f"the export left {os.listdir(ws)}"
        p = run_ckptctl("gc-tmp", ws, "--check")
        assert p.returncode == 0, p.stdout + p.stderr
    assert which_version(dest) == 2
    # stubs a killed writer leaves: an empty directory, one with an empty lock, one with both
    # empty files; gc-tmp never creates a lock in them (it would be silly-renamed/hidden)
    for entries in ((), (staging.LOCK,), (staging.LOCK, staging.OWNER)):
        d = ws / staging.staging_name(DEST)
        d.mkdir()
        for n in entries:
            (d / n).touch()
    rc, doc = gc_tmp(ws)
    assert rc == 0 and [c["decision"] for c in doc["candidates"]] == ["removed"] * 3, doc
    assert os.listdir(ws) == [DEST]
    assert sorted(os.listdir(m.backing / "ws")) == [DEST]  # nothing hidden left in the store either


# ---------------------------------------------------------------------------------------------
# 5. a second writer during the window; a lost reply on the second rename


def test_resave_during_another_writers_window_refuses_as_a_second_writer(nfs, tmp_path):
    src, ws, dest = workspace(nfs, tmp_path, 1, 2)
    with paused_in_window(src[2], dest) as w:
        assert not os.path.lexists(dest)
        p = run_ckptctl("resave", dest, "--repair")
        assert p.returncode == 3 and "another writer is already writing" in p.stderr, p.stderr
        p = run_ckptctl("export", src[1], dest, "--overwrite")
        assert p.returncode == 3 and "another writer is already writing" in p.stderr, p.stderr
    out, err = w.communicate(timeout=120)
    assert w.returncode == 0, err
    assert which_version(dest) == 2 and staging_dirs(ws) == []


@pytest.mark.parametrize("overwrite,flags", [(True, False), (False, False), (False, True)])
def test_lost_reply_on_the_publishing_rename_reports_success(mount, tmp_path, overwrite, flags):
    """``data -> dest`` is done but answered EIO: the new version is in place, and the command says
    so (it used to report "nothing was published"). ``flags``: the mount supports renameat2 flags,
    so a new destination is published with ``RENAME_NOREPLACE`` itself."""
    m = mount(refuse_rename_flags=not flags, silly="nfs", cache=60)
    src, ws, dest = workspace(m, tmp_path, 1, 2, first=overwrite)
    m.lose_reply(src=staging.DATA, dst=DEST)
    p = run_ckptctl("export", src[2], dest, *(["--overwrite"] if overwrite else []), "--json")
    assert len(m.faults("lost-reply")) == 1
    assert bool(m.faults("rename-flags-refused")) is not flags
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["publish"] == ("two-rename" if overwrite else "rename")
    assert "nothing was published" not in p.stderr
    assert which_version(dest) == 2 and staging_dirs(ws) == []


# ---------------------------------------------------------------------------------------------
# object-store mounts: a directory rename is a copy and a delete


@pytest.mark.parametrize("fstype", ["gcsfuse", "s3fs"])
def test_overwrite_is_refused_on_object_store_mounts(mount, tmp_path, fstype):
    m = mount(refuse_rename_flags=True, silly="none", subtype=fstype)
    src, ws, dest = workspace(m, tmp_path, 1, 2)  # a new directory: nothing to replace
    p = run_ckptctl("export", src[2], dest, "--overwrite")
    assert p.returncode == 3 and f"fuse.{fstype}" in p.stderr and "cannot be atomic" in p.stderr, p.stderr
    assert which_version(dest) == 1 and os.listdir(ws) == [DEST]
