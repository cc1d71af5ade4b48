"""A filesystem mounted inside a destination is never emptied, never copied across silently
(issue 33, hardening round 3), on real mounts (tmpfs, bind mounts of the same filesystem, a file
bind-mounted over a file) and real processes.

A directory rename carries the mounts below it: ``RENAME_EXCHANGE`` of ``DST`` moved the user's
``DST/datasets`` mount into the staging directory, whose removal then unlinked every file of the
mounted filesystem (exit 0, the staging directory leaked: the mount point cannot be removed). Now
``export``/``resave`` refuse a destination with a mount below it before anything is written
(exit 2), a mount made while the export writes stops the publish (exit 3, nothing replaced), and
the one removal (``staging.fs``: publish cleanup, gc-tmp, resave) never crosses a mount point: it
raises ``staging.MountInside`` and leaves the mounted filesystem as it is.

Run as root (mounting); a test skips only where ``mount`` itself is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
import pytest

from ckptctl import staging
from tests.support import (exported_old_version, load_glob, popen_ckptctl, run_ckptctl, same, snapshot,
                          staging_dirs, state, wait_stopped, write_new_version)

def _mountpoints_below(root: Path) -> list[str]:
    real = os.path.realpath(root) + "/"
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(real):
                out.append(point)
    return out


@pytest.fixture
def mounts(tmp_path: Path):
    """``mounts.tmpfs(where)``, ``mounts.bind(what, where)``: real mounts, skipped where mounting
    is refused; at the end every mount below ``tmp_path`` is detached, wherever it went (the old
    code moved them into staging directories)."""

    class M:
        @staticmethod
        def _run(argv: list[str]) -> None:
            r = subprocess.run(argv, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot mount here: {r.stderr.strip()}")

        def tmpfs(self, where: Path) -> Path:
            where.mkdir(parents=True, exist_ok=True)
            self._run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)])
            return where

        def bind(self, what: Path, where: Path) -> Path:
            if what.is_dir():
                where.mkdir(parents=True, exist_ok=True)
            elif not where.exists():
                where.write_text("")
            self._run(["mount", "--bind", str(what), str(where)])
            return where

    yield M()
    for point in sorted(_mountpoints_below(tmp_path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_new_version(tmp_path / "src")


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    return exported_old_version(tmp_path / "v1", tmp_path / "ckpt")


def _mount_below(kind: str, dest: Path, tmp_path: Path, mounts) -> tuple[Path, Path]:
    """A mount of ``kind`` below ``dest`` holding a user's file; returns (mount point, that file)."""
    if kind == "tmpfs":
        point = mounts.tmpfs(dest / "datasets")
    elif kind == "nested-tmpfs":
        point = mounts.tmpfs(dest / "logs" / "tb")
    elif kind == "bind-same-fs":  # a bind mount of the same filesystem: st_dev is equal on both sides
        (tmp_path / "shared").mkdir()
        point = mounts.bind(tmp_path / "shared", dest / "datasets")
        assert os.stat(point).st_dev == os.stat(dest).st_dev
    else:  # a file bind-mounted over a file (a Kubernetes subPath of a config map)
        (tmp_path / "team-notes.txt").write_text("the team's notes")
        point = mounts.bind(tmp_path / "team-notes.txt", dest / "notes.txt")
        return point, point
    user_file = point / "train.jsonl"
    user_file.write_text('{"text": "mine"}\n')
    return point, user_file


KINDS = ["tmpfs", "nested-tmpfs", "bind-same-fs", "file"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["export", "resave"])
def test_a_mount_below_the_destination_is_refused_up_front(src, dest, tmp_path, mounts, kind, command):
    point, user_file = _mount_below(kind, dest, tmp_path, mounts)
    before = snapshot(dest)
    if command == "export":
        r = run_ckptctl("export", src, dest, "--overwrite")
    else:
        r = run_ckptctl("resave", dest, "--dtype", "bf16")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and str(point) in lines[0] and "mount" in lines[0], r.stderr
    assert any(line.startswith("hint: ") for line in lines[1:]) and "Traceback" not in r.stderr, r.stderr
    assert snapshot(dest) == before  # nothing written, nothing removed
    assert user_file.read_text() in ('{"text": "mine"}\n', "the team's notes")
    assert os.path.realpath(point) in _mountpoints_below(dest)  # the mount is where it was
    assert staging_dirs(tmp_path) == []


def test_the_refusal_is_one_json_document(src, dest, tmp_path, mounts):
    mounts.tmpfs(dest / "datasets")
    r = run_ckptctl("export", src, dest, "--overwrite", "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and "mount" in json.dumps(doc)
    assert staging_dirs(tmp_path) == []


def test_a_mount_made_while_the_export_writes_stops_the_publish(src, dest, tmp_path, mounts):
    """Checked again just before the exchange: a volume mounted into the destination while the
    shards are written is never moved into the staging directory, never emptied."""
    proc = popen_ckptctl("export", src, dest, "--overwrite", env={"CKPTCTL_STOP_AT": "shard-start"})
    wait_stopped(proc.pid)
    point = mounts.tmpfs(dest / "datasets")
    (point / "train.jsonl").write_text("mine")
    before = snapshot(dest)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "mount" in err and str(point) in err and "Traceback" not in err, err
    assert snapshot(dest) == before and (point / "train.jsonl").read_text() == "mine"
    assert same(load_glob(dest), state(1, n=4))  # the old version, untouched
    assert staging_dirs(tmp_path) == []


def test_a_mount_in_the_replaced_version_is_not_emptied_after_the_publish(src, dest, tmp_path, mounts):
    """The last line of defence: a mount that got into the old version (the instant between the
    check and the exchange) makes the cleanup stop, say where, and keep the staging directory."""
    proc = popen_ckptctl("export", src, dest, "--overwrite", env={"CKPTCTL_STOP_AT": "after-publish"})
    wait_stopped(proc.pid)
    [stage] = staging_dirs(tmp_path)
    point = mounts.tmpfs(stage / staging.DATA / "datasets")
    (point / "train.jsonl").write_text("mine")
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "mount" in err and str(point) in err and "Traceback" not in err, err
    assert (point / "train.jsonl").read_text() == "mine"
    assert same(load_glob(dest), state(7, n=4))  # the new version is published
    assert staging_dirs(tmp_path) == [stage]


@pytest.mark.parametrize("kind", ["tmpfs", "bind-same-fs", "file"])
def test_the_removal_never_descends_into_a_mount(tmp_path, mounts, kind):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "ours.bin").write_bytes(b"x" * 100)
    if kind == "tmpfs":
        point = mounts.tmpfs(tree / "sub" / "mnt")
        (point / "a.txt").write_text("keep me")
        (point / "deep").mkdir()
        (point / "deep" / "b.txt").write_text("keep me too")
    elif kind == "bind-same-fs":
        (tmp_path / "shared" / "deep").mkdir(parents=True)
        (tmp_path / "shared" / "deep" / "b.txt").write_text("keep me too")
        point = mounts.bind(tmp_path / "shared", tree / "sub" / "mnt")
    else:
        (tmp_path / "notes.txt").write_text("keep me")
        point = mounts.bind(tmp_path / "notes.txt", tree / "sub" / "notes.txt")
    inside = snapshot(point) if point.is_dir() else point.read_text()
    with pytest.raises(OSError) as info:
        staging.remove_tree(tree)
    assert (snapshot(point) if point.is_dir() else point.read_text()) == inside  # nothing of the mount unlinked
    assert isinstance(info.value, staging.MountInside) and info.value.filename == str(point)
    assert "mount" in str(info.value)
    assert os.path.realpath(point) in _mountpoints_below(tmp_path)


def test_gc_tmp_never_empties_a_mount_inside_a_dead_staging_directory(src, dest, tmp_path, mounts):
    r = run_ckptctl("export", src, dest, "--overwrite", env={"CKPTCTL_KILL_AT": "shard-start"})
    assert r.returncode == -9
    [stage] = staging_dirs(tmp_path)
    point = mounts.tmpfs(stage / staging.DATA / "scratch")
    (point / "results.json").write_text("mine")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "b.txt").write_text("mine too")
    bound = mounts.bind(tmp_path / "shared", stage / staging.DATA / "bound")
    g = run_ckptctl("gc-tmp", tmp_path, "--min-age", "0")
    assert g.returncode == 3, g.stderr
    assert "mount" in g.stderr and "Traceback" not in g.stderr, g.stderr
    assert (point / "results.json").read_text() == "mine"
    assert (bound / "b.txt").read_text() == "mine too" and (tmp_path / "shared" / "b.txt").exists()
    assert stage.is_dir()
    assert same(load_glob(dest), state(1, n=4))


@pytest.mark.parametrize("seam", ["statx", "fdinfo", "no-mountinfo"])
def test_every_way_of_telling_a_mount_finds_a_bind_mount_of_the_same_filesystem(tmp_path, mounts, monkeypatch, seam):
    """``statx(STATX_MNT_ID)`` where the kernel has it, ``/proc/self/fdinfo``'s ``mnt_id`` before
    Linux 5.8, a walk where ``/proc/self/mountinfo`` cannot be read: each finds a bind mount
    whose ``st_dev`` equals its parent's, and the removal stops at it."""
    from ckptctl.staging import mounts as M

    if seam == "fdinfo":
        monkeypatch.setattr(M.MountProbe, "_by_statx", lambda self, fd, name: None)
    if seam == "no-mountinfo":
        monkeypatch.setattr(M, "MOUNTINFO", str(tmp_path / "no-such-file"))
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "keep.txt").write_text("mine")
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    point = mounts.bind(tmp_path / "shared", tree / "a" / "vol")
    assert os.stat(point).st_dev == os.stat(tree).st_dev
    assert staging.mounts_below(tree) == [point]
    assert staging.mounts_below(tree / "a" / "vol") == []  # strictly below
    with pytest.raises(staging.MountInside):
        staging.remove_tree(tree)
    assert (tmp_path / "shared" / "keep.txt").read_text() == "mine"


def test_a_tree_without_mounts_is_removed_as_before(tmp_path):
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_bytes(b"x" * 10)
    os.symlink("/", tree / "a" / "root-link")  # a link is removed as a link, never followed
    assert staging.mounts_below(tree) == []
    assert staging.remove_tree(tree) == 10
    assert not tree.exists()
