"""gc-tmp hardening (issue 15), on real processes: a writer starting while gc-tmp --min-age 0
runs, a leaked staging directory gc-tmp cannot read, verify --recursive over an unreadable
directory, and the opt-in presets for huggingface_hub's ``*.incomplete`` blobs and transformers
Trainer's ``tmp-checkpoint-*`` directories, which go only when no process holds them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import (CKPTCTL, clean_env, drop_dac_caps, popen_ckptctl, run_ckptctl, state, wait_stopped,
                           write_single)

OLD = time.time() - 7200  # two hours ago


def _age(path: Path, when: float = OLD) -> None:
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.utime(os.path.join(root, n), (when, when), follow_symlinks=False)
    os.utime(path, (when, when), follow_symlinks=False)


def _gc(*args: object, no_dac: bool = False) -> tuple[int, dict, str]:
    proc = subprocess.run([*CKPTCTL, "gc-tmp", *map(str, args), "--json"], capture_output=True, text=True,
                          env=clean_env(), timeout=120,
                          preexec_fn=drop_dac_caps if no_dac and os.geteuid() == 0 else None)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.fixture
def src(tmp_path: Path) -> Path:
    write_single(tmp_path / "src", state(3, n=4))
    return tmp_path / "src"


# ---------------------------------------------------------------------------------------------
# a writer starting while gc-tmp --min-age 0 runs


def test_a_starting_writer_is_invisible_until_its_lock_is_held(src, tmp_path):
    """Stopped after mkdir, lock and owner record, before the rename that makes it visible:
    gc-tmp --min-age 0 keeps it; the writer then finishes."""
    out = tmp_path / "work"
    out.mkdir()
    proc = popen_ckptctl("export", src, out / "ckpt", env={"CKPTCTL_STOP_AT": "stage-visible"})
    wait_stopped(proc.pid)
    hidden = [p for p in out.iterdir() if p.name.startswith("._tmp_ckpt.")]
    assert len(hidden) == 1 and {p.name for p in hidden[0].iterdir()} == {"lock", "owner.json", "data"}
    rc, doc, err = _gc(out, "--min-age", "0")
    assert rc == 0 and doc["removed"] == 0 and hidden[0].is_dir(), err
    proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=120) == 0
    assert (out / "ckpt" / "model.safetensors").is_file() and os.listdir(out) == ["ckpt"]


def test_a_writer_killed_before_it_became_visible_is_removed_after_the_grace(src, tmp_path):
    out = tmp_path / "work"
    out.mkdir()
    r = run_ckptctl("export", src, out / "ckpt", env={"CKPTCTL_KILL_AT": "stage-visible"})
    assert r.returncode == -signal.SIGKILL
    [hidden] = [p for p in out.iterdir()]
    assert hidden.name.startswith("._tmp_ckpt.")
    rc, doc, _ = _gc(out, "--min-age", "0")
    assert rc == 0 and doc["removed"] == 0 and hidden.is_dir()
    assert "not made visible yet" in doc["candidates"][0]["reason"]
    _age(hidden)
    rc, doc, _ = _gc(out, "--min-age", "0")
    assert rc == 0 and doc["removed"] == 1 and os.listdir(out) == []


def test_exports_in_a_loop_against_gc_min_age_0(src, tmp_path):
    """Before issue 15, 3 of 62 exports failed: gc-tmp removed a staging directory between its
    mkdir and its writer's flock."""
    out = tmp_path / "work"
    out.mkdir()
    stop = tmp_path / "stop"
    gc_loop = subprocess.Popen(
        [sys.executable, "-c",
         "import os, subprocess, sys\n"
         "n = 0\n"
         "while not os.path.exists(sys.argv[1]):\n"
         "    r = subprocess.run([sys.executable, '-m', 'ckptctl', 'gc-tmp', sys.argv[2], '--min-age', '0', '-q'], stdout=subprocess.DEVNULL)\n"
         "    assert r.returncode == 0, r.returncode\n"
         "    n += 1\n"
         "print(n)\n", str(stop), str(out)],
        stdout=subprocess.PIPE, text=True, env=clean_env())
    failures = []
    try:
        for i in range(24):
            r = run_ckptctl("export", src, out / f"ckpt{i}")
            if r.returncode != 0:
                failures.append(r.stderr)
    finally:
        stop.touch()
        runs, _ = gc_loop.communicate(timeout=120)
    assert gc_loop.returncode == 0 and int(runs) > 0
    assert failures == []
    assert sorted(os.listdir(out)) == sorted(f"ckpt{i}" for i in range(24))


# ---------------------------------------------------------------------------------------------
# what cannot be read is reported


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's capabilities to make permissions apply")
def test_check_over_an_unreadable_leaked_staging_directory_fails(tmp_path):
    leak = tmp_path / "_tmp_ckpt.18ecc906440da92e-4404158d"
    (leak / "data").mkdir(parents=True)
    os.chmod(leak, 0)
    try:
        rc, doc, err = _gc(tmp_path, "--check", "--min-age", "0", no_dac=True)
    finally:
        os.chmod(leak, 0o755)
    assert rc == 3, err
    assert [c["path"] for c in doc["candidates"]] == [str(leak)]
    assert any(p["path"] == str(leak) and "Permission denied" in p["message"] for p in doc["errors"]), doc
    assert f"error: {leak}: cannot read this staging directory: Permission denied" in err


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's capabilities to make permissions apply")
def test_verify_recursive_over_an_unreadable_directory_fails(src, tmp_path):
    root = tmp_path / "tree"
    run_ckptctl("export", src, root / "ok", check=True)
    run_ckptctl("export", src, root / "locked" / "ckpt", check=True)
    os.chmod(root / "locked", 0)
    try:
        proc = subprocess.run([*CKPTCTL, "verify", "-r", str(root), "--json"], capture_output=True, text=True,
                              env=clean_env(), timeout=120, preexec_fn=drop_dac_caps)
    finally:
        os.chmod(root / "locked", 0o755)
    assert proc.returncode == 3, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False
    bad = [r for r in doc["results"] if not r["ok"]]
    assert len(bad) == 1 and bad[0]["path"].endswith("locked"), doc["results"]
    assert {f["code"] for f in bad[0]["findings"]} == {"io.error"}, bad[0]["findings"]


# ---------------------------------------------------------------------------------------------
# presets for the ecosystem's leaks: only what no process holds


def _holder(path: Path, how: str) -> subprocess.Popen:
    code = {"open": "f = open(sys.argv[1], 'ab')",
            "open-inside": "f = open(os.path.join(sys.argv[1], 'optimizer.pt'), 'ab')",
            "cwd": "os.chdir(sys.argv[1])"}[how]
    p = subprocess.Popen([sys.executable, "-c", f"import os, sys, time\n{code}\nprint('ready', flush=True)\n"
                          "time.sleep(120)\n", str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _preset_tree(tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    blobs = root / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "aaaa.incomplete").write_bytes(b"half a download")
    (blobs / "bbbb.incomplete").write_bytes(b"another half")
    for n in ("tmp-checkpoint-100", "tmp-checkpoint-200", "tmp-checkpoint-300"):
        (root / "run" / n).mkdir(parents=True)
        (root / "run" / n / "model.safetensors").write_bytes(b"x")
        (root / "run" / n / "optimizer.pt").write_bytes(b"o")
    _age(root)
    return root


def test_presets_remove_only_what_no_process_holds(tmp_path):
    root = _preset_tree(tmp_path)
    blobs = root / "models--org--m" / "blobs"
    holders = [_holder(blobs / "aaaa.incomplete", "open"), _holder(root / "run" / "tmp-checkpoint-100", "open-inside"),
               _holder(root / "run" / "tmp-checkpoint-200", "cwd")]
    try:
        rc, doc, err = _gc(root, "--preset", "incomplete", "--preset", "trainer-tmp", "--older-than", "1m",
                           "--min-age", "0")
    finally:
        for h in holders:
            h.kill()
            h.wait()
    assert rc == 0, err
    decided = {Path(c["path"]).name: (c["decision"], c["reason"]) for c in doc["candidates"]}
    assert decided["aaaa.incomplete"][0] == "kept" and "holds it open" in decided["aaaa.incomplete"][1]
    assert decided["tmp-checkpoint-100"][0] == "kept" and "a file in it" in decided["tmp-checkpoint-100"][1]
    assert decided["tmp-checkpoint-200"][0] == "kept"
    assert decided["bbbb.incomplete"][0] == "removed" and decided["tmp-checkpoint-300"][0] == "removed"
    assert sorted(os.listdir(blobs)) == ["aaaa.incomplete"]
    assert sorted(os.listdir(root / "run")) == ["tmp-checkpoint-100", "tmp-checkpoint-200"]


def test_presets_are_opt_in(tmp_path):
    root = _preset_tree(tmp_path)
    rc, doc, _ = _gc(root, "--older-than", "1m", "--min-age", "0")
    assert rc == 0 and doc["candidates"] == []
