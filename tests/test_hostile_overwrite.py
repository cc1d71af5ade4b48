"""Nothing an operator owns is lost when a checkpoint is replaced (issue 15, DESIGN I3), on real
files and real processes: files a concurrent process adds to the destination while the export
writes its shards, files whose names are not provably ours, and the destination's permissions
(mode with setgid, group, owner, POSIX ACLs, carried subdirectories' modes)."""

from __future__ import annotations

import errno
import grp
import json
import os
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support import (clean_env, exported_old_version, load_glob, popen_ckptctl, run_ckptctl, same, state,
                          wait_stopped, write_new_version)

ACL = "system.posix_acl_access"
DEFAULT_ACL = "system.posix_acl_default"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_new_version(tmp_path / "src")


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """The destination's previous version, with a teammate's README."""
    return exported_old_version(tmp_path / "old", tmp_path / "out")


# the concurrent writer: a separate process that writes into the destination, as an eval job does
WRITER = r"""
import os, sys
dest = sys.argv[1]
with open(os.path.join(dest, "eval_results.json"), "w") as f:
    f.write('{"mmlu": 0.61}')
os.mkdir(os.path.join(dest, "logs"))
with open(os.path.join(dest, "logs", "run.log"), "w") as f:
    f.write("step 100\n")
with open(os.path.join(dest, "README.md.tmp"), "w") as f:  # an editor's atomic save
    f.write("v2 notes")
os.rename(os.path.join(dest, "README.md.tmp"), os.path.join(dest, "README.md"))
with open(os.path.join(dest, "config.json.tmp"), "w") as f:  # a name the new version writes too
    f.write('{"edited": true}')
os.rename(os.path.join(dest, "config.json.tmp"), os.path.join(dest, "config.json"))
"""


@pytest.mark.parametrize("stop", ["stage-create", "shard-start"])
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-rename"])
def test_files_added_while_the_export_writes_are_carried(src, old, exchange, stop):
    """At stage-create the plan has listed the destination but no staging directory exists yet
    (the files appear in the gap between the two); at shard-start the shards are being written."""
    env = {"CKPTCTL_STOP_AT": stop}  # one shard: one stop
    if not exchange:
        env["CKPTCTL_FAIL_AT"] = "exchange:EINVAL"  # the NFS path: two journaled renames
    proc = popen_ckptctl("export", src, old, "--overwrite", "--json", env=env)
    wait_stopped(proc.pid)  # the carried-file list is fixed; the shards are being written
    w = subprocess.run([sys.executable, "-c", WRITER, str(old)], env=clean_env(), timeout=60)
    assert w.returncode == 0
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert (old / "eval_results.json").read_text() == '{"mmlu": 0.61}'
    assert (old / "logs" / "run.log").read_text() == "step 100\n"
    assert (old / "README.md").read_text() == "v2 notes"  # the edit, not the carried previous inode
    # the new version writes its own config.json: the teammate's edit is kept beside it
    assert json.loads((old / "config.json.ckptctl-kept").read_text()) == {"edited": True}
    assert json.loads((old / "config.json").read_text())["model_type"] == "llama"
    assert {"eval_results.json", "logs", "config.json.ckptctl-kept"} <= set(doc["carried"]), doc["carried"]
    assert same(load_file(str(old / "model.safetensors")), state(7, n=4))
    assert same(load_glob(old), state(7, n=4))
    assert [p.name for p in old.parent.iterdir() if p.name.startswith(("_tmp_", "._tmp_"))] == []


def test_names_that_are_not_provably_ours_are_carried(src, old):
    save = load_file(str(old / "model.safetensors"))
    from safetensors.torch import save_file

    save_file(save, str(old / "optimizer.safetensors"))
    save_file(save, str(old / "mm_projector.safetensors"))
    (old / ".tmpl").mkdir()
    (old / ".tmpl" / "prompt.txt").write_text("{{x}}")
    (old / "_tmp_scratch").mkdir()
    (old / "_tmp_scratch" / "notes").write_text("mine")
    (old / "tmp-checkpoint-12").mkdir()  # transformers Trainer's staging: an exact known leftover
    (old / "shard.incomplete").write_bytes(b"partial")  # huggingface_hub's: known, but held open below
    (old / "blob.incomplete").write_bytes(b"partial")
    holder = subprocess.Popen([sys.executable, "-c", "import sys,time; f=open(sys.argv[1],'ab'); "
                               "print('open', flush=True); time.sleep(120)", str(old / "shard.incomplete")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        r = run_ckptctl("export", src, old, "--overwrite", "--json", check=True)
    finally:
        holder.kill()
        holder.wait()
    doc = json.loads(r.stdout)
    names = set(os.listdir(old))
    assert {"optimizer.safetensors", "mm_projector.safetensors", ".tmpl", "_tmp_scratch", "README.md",
            "shard.incomplete"} <= names, names
    assert "tmp-checkpoint-12" not in names and "blob.incomplete" not in names
    assert same(load_file(str(old / "mm_projector.safetensors")), save)
    assert (old / "_tmp_scratch" / "notes").read_text() == "mine"
    assert set(doc["removed"]) == {"tmp-checkpoint-12", "blob.incomplete"}, doc["removed"]


def _acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


NOBODY = 65534
U = 0xFFFFFFFF
TEAM_ACL = _acl((0x01, 7, U), (0x02, 5, NOBODY), (0x04, 7, U), (0x10, 7, U), (0x20, 5, U))


def _set_acl(path: Path, name: str = ACL) -> None:
    try:
        os.setxattr(path, name, TEAM_ACL)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip("this filesystem has no POSIX ACLs")
        raise


def _group() -> int:
    """A group other than ours to give the destination (root: any; else one of ours)."""
    mine = os.getgid()
    if os.geteuid() == 0:
        return next(g.gr_gid for g in grp.getgrall() if g.gr_gid != mine)
    others = [g for g in os.getgroups() if g != mine]
    if not others:
        pytest.skip("needs a second group")
    return others[0]


@pytest.mark.parametrize("command", ["export", "resave"])
def test_permissions_are_kept(src, old, command):
    gid = _group()
    (old / "private").mkdir(mode=0o700)
    (old / "private" / "key").write_text("k")
    os.chmod(old / "private", 0o700)
    (old / "shared").mkdir()
    os.chown(old, -1, gid)
    os.chmod(old, 0o2775)
    _set_acl(old)
    _set_acl(old, DEFAULT_ACL)
    _set_acl(old / "shared")
    os.chmod(old / "shared", 0o2770)
    before = os.stat(old)
    acl = os.getxattr(old, ACL)
    if command == "export":
        run_ckptctl("export", src, old, "--overwrite", check=True)
    else:
        run_ckptctl("resave", old, "--dtype", "bf16", check=True)
    after = os.stat(old)
    assert after.st_ino != before.st_ino  # a new directory took the old one's place
    assert stat.S_IMODE(after.st_mode) == 0o2775 and after.st_gid == gid and after.st_uid == before.st_uid
    assert os.getxattr(old, ACL) == acl and os.getxattr(old, DEFAULT_ACL) == TEAM_ACL
    assert stat.S_IMODE(os.stat(old / "private").st_mode) == 0o700  # not world-readable now
    assert stat.S_IMODE(os.stat(old / "shared").st_mode) == 0o2770
    assert os.getxattr(old / "shared", ACL)[:4] == TEAM_ACL[:4]
    assert (old / "private" / "key").read_text() == "k"


def test_a_new_destination_gets_the_parents_group_by_setgid(src, tmp_path):
    gid = _group()
    parent = tmp_path / "team"
    parent.mkdir()
    os.chown(parent, -1, gid)
    os.chmod(parent, 0o2775)
    run_ckptctl("export", src, parent / "ckpt", check=True)
    st = os.stat(parent / "ckpt")
    assert st.st_gid == gid and st.st_mode & stat.S_ISGID
