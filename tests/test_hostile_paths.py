"""Hostile paths and pickles (issue #8): weight_map entries, export destinations and gc-tmp roots
that try to leave the checkpoint (an audit hook proves nothing outside is ever opened), and a
pickle whose reduce runs code, through resave. The fuzzing of the readers is in
test_hostile_inputs.py; escapes in verify are in test_verify_cli.py, gc-tmp's root checks and
symlinks in test_gc.py and test_gc_processes.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import crash_harness as H
from tests.support import INDEX, clean_env, load_glob, run_ckptctl, write_sharded, write_single


# ---------------------------------------------------------------------------------------------
# paths that try to leave the checkpoint


def _audited_ckptctl(tmp_path: Path, *args) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the CLI with an audit hook that records every file the process opens."""
    log = tmp_path / "opened.json"
    # the log is written by an exit handler, which runs as cli.main's sys.exit ends the process
    code = ("import atexit, sys, os, json, runpy\n"
            "opened = []\n"
            "def hook(event, a):\n"
            "    if event == 'open' and isinstance(a[0], (str, bytes)):\n"
            "        opened.append(os.fsdecode(a[0]))\n"
            "sys.addaudithook(hook)\n"
            "sys.argv = ['ckptctl'] + sys.argv[1:]\n"
            f"atexit.register(lambda: json.dump([os.path.realpath(p) for p in opened], open({str(log)!r}, 'w')))\n"
            "runpy.run_module('ckptctl', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120,
                       env=clean_env())
    return r, set(json.loads(log.read_text()))


def _source_with_escape(tmp_path: Path, entry: str) -> tuple[Path, Path]:
    """A 3-shard source whose index sends shard 3's tensors to ``entry``, where (outside the
    source) a valid safetensors file with exactly those tensors waits."""
    src = tmp_path / "src"
    write_sharded(src, H.model_state(2), max_shard_size=20_000)
    outside = tmp_path / "outside.safetensors"
    shutil.move(src / "model-00003-of-00003.safetensors", outside)
    idx = json.loads((src / INDEX).read_text())
    idx["weight_map"] = {k: (entry.replace("OUTSIDE", str(outside)) if v.startswith("model-00003") else v)
                         for k, v in idx["weight_map"].items()}
    (src / INDEX).write_text(json.dumps(idx))
    return src, outside


ESCAPES = ["../outside.safetensors", "OUTSIDE", "./../outside.safetensors", "sub/../../outside.safetensors"]


@pytest.mark.parametrize("entry", ESCAPES)
def test_export_refuses_a_weight_map_entry_outside_the_source_and_never_opens_it(tmp_path, entry):
    src, outside = _source_with_escape(tmp_path, entry)
    (src / "sub").mkdir()
    r, opened = _audited_ckptctl(tmp_path, "export", src, tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and H.our_staging(tmp_path) == []
    assert any(p.endswith(INDEX) for p in opened)  # the hook does see opens
    assert str(outside) not in opened


@pytest.mark.parametrize("entry", ESCAPES[:2])
def test_resave_repair_never_opens_a_weight_map_entry_outside(tmp_path, entry):
    src, outside = _source_with_escape(tmp_path, entry)
    before, index_before = outside.read_bytes(), (src / INDEX).read_bytes()
    r, opened = _audited_ckptctl(tmp_path, "resave", src, "--repair", "--json")
    assert "Traceback" not in r.stderr, r.stderr
    assert any(p.endswith(INDEX) for p in opened)  # the hook does see opens
    assert str(outside) not in opened and outside.read_bytes() == before
    assert H.our_staging(tmp_path) == []
    assert (src / INDEX).read_bytes() == index_before  # refused (see below): nothing rewritten


@pytest.mark.parametrize("entry", ESCAPES[:2])
def test_resave_repair_refuses_to_drop_the_tensors_of_an_entry_outside(tmp_path, entry):
    """README "Exit codes": 1, ``resave --repair`` refused (data is lost: the list is printed,
    nothing changed). The index names two tensors in a shard outside the checkpoint; the
    checkpoint does not hold them, so a repair cannot keep them (DESIGN.md I9: no tensor lost, or
    refuse and change nothing)."""
    src, outside = _source_with_escape(tmp_path, entry)
    lost = sorted(k for k, v in json.loads((src / INDEX).read_text())["weight_map"].items() if "outside" in v)
    before = H.snapshot(src)
    r = run_ckptctl("resave", src, "--repair")
    assert r.returncode == 1 and "error:" in r.stderr and lost[0] in r.stderr, r.stderr
    assert H.snapshot(src) == before and H.our_staging(tmp_path) == []


def test_export_destination_with_dotdot_is_resolved_lexically(tmp_path):
    """Decided behaviour: the destination is made absolute lexically (os.path.abspath), so
    ``ws/link/../ckpt`` is ``ws/ckpt`` even when ``ws/link`` is a symlink elsewhere (the kernel
    would resolve it to the link target's parent). Everything (staging, rename) happens at that
    one place; nothing is written beside the link's target."""
    src = tmp_path / "src"
    write_single(src, H.model_state(2))
    ws, far = tmp_path / "ws", tmp_path / "far" / "deep"
    far.mkdir(parents=True)
    ws.mkdir()
    (ws / "link").symlink_to(far)
    r = run_ckptctl("export", src, f"{ws}/link/../ckpt")
    assert r.returncode == 0, r.stderr
    assert H.check_version(ws / "ckpt", load_glob(src)) == []
    assert sorted(os.listdir(tmp_path / "far")) == ["deep"] and os.listdir(far) == []
    assert H.our_staging(ws) == [] and (ws / "link").is_symlink()


def test_export_destination_whose_parent_is_a_symlink_lands_in_the_target(tmp_path):
    """The parent may be a symlink (to another filesystem even): the staging directory is made
    next to the destination *through* the link, so it is on the destination's filesystem; the
    link itself is left alone."""
    src = tmp_path / "src"
    write_single(src, H.model_state(2))
    target = tmp_path / "target"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(target)],
                             capture_output=True).returncode == 0  # another filesystem when allowed
    try:
        (tmp_path / "ws").mkdir()
        link = tmp_path / "ws" / "models"
        link.symlink_to(target)
        for attempt in range(2):  # the second run replaces the first version
            r = run_ckptctl("export", src, link / "ckpt", "--overwrite")
            assert r.returncode == 0, r.stderr
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert H.check_version(target / "ckpt", load_glob(src)) == []
        assert sorted(os.listdir(target)) == ["ckpt"] and os.listdir(tmp_path / "ws") == ["models"]
        if mounted:
            assert os.stat(target / "ckpt").st_dev != os.stat(tmp_path).st_dev
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.mark.parametrize("dst", ["file", "fifo", "dev-null"])
def test_export_over_something_that_is_not_a_directory_is_refused(tmp_path, dst):
    src = tmp_path / "src"
    write_single(src, H.model_state(2))
    target = {"file": tmp_path / "f", "fifo": tmp_path / "p", "dev-null": Path("/dev/null")}[dst]
    if dst == "file":
        target.write_text("keep")
    elif dst == "fifo":
        os.mkfifo(target)  # opening it would block: refusing must not open it
    r = run_ckptctl("export", src, target, "--overwrite")
    # README "Exit codes": 2, a usage error: the destination names something that is not a
    # checkpoint directory, and --overwrite replaces checkpoints only.
    assert r.returncode == 2 and "not a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    if dst == "file":
        assert target.read_text() == "keep"
    assert H.our_staging(tmp_path) == [] and not list(Path("/dev").glob("_tmp_null.*"))


def test_gc_never_follows_a_staging_named_symlink(tmp_path):
    """A ``_tmp_<name>.<stamp>-<rand>`` entry that is a symlink to a dead writer's staging
    directory elsewhere: gc-tmp may remove the link, never anything behind it."""
    p = subprocess.Popen(["sleep", "60"])
    from ckptctl import staging

    start = staging.process_start_time(p.pid)
    p.kill()
    p.wait()
    elsewhere = tmp_path / "elsewhere"
    victim = elsewhere / staging.staging_name("ckpt")
    (victim / "data").mkdir(parents=True)
    (victim / "data" / "model.safetensors").write_bytes(b"precious")
    (victim / "lock").touch()
    rec = staging.owner_record(elsewhere / "ckpt", "test")
    rec.update(pid=p.pid, start_time=start)
    (victim / "owner.json").write_text(json.dumps(rec))
    root = tmp_path / "root"
    root.mkdir()
    (root / victim.name).symlink_to(victim)
    (root / "_tmp_x.0000000000000002-00000000").symlink_to(elsewhere)
    before = H.snapshot(elsewhere)
    r = run_ckptctl("gc-tmp", root, "--min-age", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert H.snapshot(elsewhere) == before


def test_gc_root_given_through_dotdot_and_a_symlink_stays_inside_it(tmp_path):
    """``gc-tmp ws/sub/..`` and ``gc-tmp link-to-ws`` clean ws and nothing beside it."""
    from ckptctl import staging

    p = subprocess.Popen(["sleep", "60"])
    start = staging.process_start_time(p.pid)
    p.kill()
    p.wait()

    def dead(parent: Path) -> Path:
        d = parent / staging.staging_name("ckpt")
        (d / "data").mkdir(parents=True)
        (d / "lock").touch()
        rec = staging.owner_record(parent / "ckpt", "test")
        rec.update(pid=p.pid, start_time=start)
        (d / "owner.json").write_text(json.dumps(rec))
        return d

    ws, beside = tmp_path / "ws", tmp_path / "beside"
    (ws / "sub").mkdir(parents=True)
    beside.mkdir()
    a, b = dead(ws), dead(beside)
    (tmp_path / "link").symlink_to(ws)
    for root in (f"{ws}/sub/..", str(tmp_path / "link")):
        r = run_ckptctl("gc-tmp", root, "--min-age", "0", "--max-depth", "1")
        assert r.returncode == 0, r.stderr
        assert not a.exists() and b.exists()
        a = dead(ws)


# ---------------------------------------------------------------------------------------------
# a pickle that would run code, through resave


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("layout", ["pickle-only", "beside-safetensors"])
def test_resave_refuses_a_pickle_that_runs_code_and_never_runs_it(tmp_path, layout):
    import torch

    marker = tmp_path / "pwned"
    d = tmp_path / "c"
    d.mkdir()
    if layout == "beside-safetensors":
        write_single(d, H.model_state(1))
    torch.save({"w": torch.zeros(2), "x": _Evil(str(marker))}, d / "pytorch_model.bin")
    before = H.snapshot(d)
    extra = ["--prefer", "pytorch"] if layout == "beside-safetensors" else []
    r = run_ckptctl("resave", d, "--repair", *extra)
    assert r.returncode == 2 and "refused to unpickle" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()
    assert H.snapshot(d) == before and H.our_staging(tmp_path) == []
    # control: the payload is live
    torch.load(d / "pytorch_model.bin", weights_only=False)
    assert marker.exists()
