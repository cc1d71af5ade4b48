"""``--manifest`` in a hostile destination (issue 33): the manifest lists exactly what was
published, each file read once, bounded, regular files only. A FIFO the user keeps in the
destination never hangs the export (it is not listed); a link out of the tree (``/dev/zero``, a
file beside the checkpoint, an absolute path) is never read; a link inside the new version is
hashed as the new version's file, not the old one's; and a file the user adds to the destination
while the export runs, carried into the new version, is listed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading

import pytest

from ckptctl.manifest import MANIFEST_NAME, build_manifest, sha256_file
from tests.support import run_ckptctl, state, write_config, write_sharded


def _src(tmp_path, seed=1):
    src = tmp_path / f"src{seed}"
    write_sharded(src, state(seed, n=4), per_shard=2)
    write_config(src, hidden_size=32 + seed)
    return src


def _manifest(d):
    return json.loads((d / MANIFEST_NAME).read_text())["files"]


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_fifo_in_the_destination_never_hangs_the_manifest(tmp_path):
    dst = tmp_path / "dst"
    run_ckptctl("export", _src(tmp_path), dst, "-q", check=True)
    os.mkfifo(dst / "events.pipe")
    os.mkdir(dst / "logs")
    os.mkfifo(dst / "logs" / "tail.pipe")
    try:
        done = run_ckptctl("export", _src(tmp_path, 2), dst, "--overwrite", "--manifest", "-q", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("export --manifest blocked on a FIFO in the destination")
    assert done.returncode == 0, done.stderr
    files = _manifest(dst)
    assert "events.pipe" not in files and "logs/tail.pipe" not in files
    assert (dst / "events.pipe").exists()  # the user's FIFO is kept, only not listed
    for name, entry in files.items():
        assert entry == {"size": (dst / name).stat().st_size, "sha256": _sha(dst / name)}, name


def test_links_out_of_the_tree_are_never_read_and_links_inside_hash_the_new_version(tmp_path):
    dst = tmp_path / "dst"
    run_ckptctl("export", _src(tmp_path), dst, "-q", check=True)
    (tmp_path / "secret.txt").write_text("not the checkpoint's")
    os.symlink("/dev/zero", dst / "zero.bin")  # read forever if followed
    os.symlink("../secret.txt", dst / "notes.txt")  # a file beside the checkpoint
    os.symlink(str(tmp_path / "secret.txt"), dst / "abs.txt")
    os.symlink("config.json", dst / "config-link.json")  # inside: the new version's config
    os.symlink("missing.json", dst / "dangling.json")
    old_config = (dst / "config.json").read_bytes()
    done = run_ckptctl("export", _src(tmp_path, 2), dst, "--overwrite", "--manifest", "-q", timeout=60)
    assert done.returncode == 0, done.stderr
    files = _manifest(dst)
    assert (dst / "config.json").read_bytes() != old_config
    for name in ("zero.bin", "notes.txt", "abs.txt", "dangling.json"):
        assert name not in files, name
        assert os.path.islink(dst / name)  # kept as the user left it
    assert files["config-link.json"] == files["config.json"] == {
        "size": (dst / "config.json").stat().st_size, "sha256": _sha(dst / "config.json")}


def test_the_hash_reads_regular_files_only_and_never_blocks(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    result: list[BaseException] = []

    def read():
        try:
            sha256_file(tmp_path / "pipe")
        except BaseException as exc:  # noqa: BLE001 - the test wants to see what it raised
            result.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "sha256_file blocked on a FIFO"
    assert isinstance(result[0], OSError)
    (tmp_path / "real").write_bytes(b"x" * 1000)
    os.symlink("real", tmp_path / "link")
    with pytest.raises(OSError):
        sha256_file(tmp_path / "link")  # never through a link at the last component
    assert sha256_file(tmp_path / "real") == hashlib.sha256(b"x" * 1000).hexdigest()
    doc = build_manifest(tmp_path, ["pipe", "real", "link"])
    assert sorted(doc["files"]) == ["link", "real"]
    assert doc["files"]["link"] == doc["files"]["real"]


def test_files_added_while_the_export_runs_are_in_the_manifest(tmp_path):
    """The trainer writes into the destination while the new version is written (stopped after
    its shards, before the manifest and the publish: the files are carried late): the published
    manifest lists them, with the bytes they have, and verify --deep agrees."""
    import signal

    from tests.support import popen_ckptctl, wait_stopped

    dst = tmp_path / "dst"
    run_ckptctl("export", _src(tmp_path), dst, "-q", check=True)
    proc = popen_ckptctl("export", _src(tmp_path, 2), dst, "--overwrite", "--manifest", "-q",
                         env={"CKPTCTL_STOP_AT": "manifest-written"})
    try:
        wait_stopped(proc.pid)
        (dst / "events.log").write_text("step 2\n")
        (dst / "runs").mkdir()
        (dst / "runs" / "a.txt").write_text("late run\n")
    finally:
        proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    files = _manifest(dst)
    for name in ("events.log", "runs/a.txt"):
        assert files[name] == {"size": (dst / name).stat().st_size, "sha256": _sha(dst / name)}, name
    assert not [p for p in dst.iterdir() if p.name.endswith(".tmp")]
    done = run_ckptctl("verify", "--deep", dst)
    assert done.returncode == 0, done.stdout + done.stderr
