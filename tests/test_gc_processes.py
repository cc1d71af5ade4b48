"""gc-tmp against real writer processes: paused (SIGSTOP), killed (SIGKILL), half-published,
and two gc runs at once. Writers are ``python -m ckptctl export`` or the library API."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptctl import staging
from tests.support import load_glob as _load
from tests.support import same as _same
from tests.support import wait_stopped
from tests.test_gc import backdate, dead_pid, decisions, gc_json, gc_proc, make_dead, snapshot  # noqa: F401 (fixture)

ENV_CLEAN = {k: v for k, v in os.environ.items() if not k.startswith("CKPTCTL_")}

# A library writer that stops itself (SIGSTOP) right after its first tensor is on disk: paused
# mid-write with its lock held, deterministically (no polling, no sleeps).
PAUSING_WRITER = """
import os, signal, sys
from ckptctl.api import CheckpointWriter
src, dest = sys.argv[1], sys.argv[2]
state = {"stopped": False}
def progress(event):
    if event.phase == "write" and not state["stopped"]:
        state["stopped"] = True
        os.kill(os.getpid(), signal.SIGSTOP)
w = CheckpointWriter(dest, overwrite=True, max_shard_size="64KB", progress=progress)
for i in range(8):
    w.add_range(f"layer.{i}.weight", "F32", (64, 64), src, i * 64 * 64 * 4)
w.write()
"""


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(8)}


def _export(src: Path, dst: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptctl", "export", str(src), str(dst), "--max-shard-size", "20KB",
                           *extra], capture_output=True, text=True, env={**ENV_CLEAN, **(env or {})}, timeout=120)


@pytest.fixture
def ckpts(tmp_path):
    """root/ with a published checkpoint ``dst`` (old version) and a source ``src`` (new version)."""
    root = tmp_path / "root"
    src = tmp_path / "src"
    src.mkdir()
    save_file(_tensors(2), str(src / "model.safetensors"))
    (src / "config.json").write_text('{"model_type": "llama"}')
    old_src = tmp_path / "old_src"
    old_src.mkdir()
    save_file(_tensors(1), str(old_src / "model.safetensors"))
    root.mkdir()
    assert _export(old_src, root / "dst").returncode == 0
    (root / "dst" / "README.md").write_text("mine")
    return root, src, _tensors(1), _tensors(2)


def _staging(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if staging.parse_name(p.name))


# ---------------------------------------------------------------------------------------------


def test_paused_writer_keeps_its_directory_and_completes_after_sigcont(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    raw = tmp_path / "raw.bin"
    want = _tensors(3)
    raw.write_bytes(b"".join(want[f"layer.{i}.weight"].numpy().tobytes() for i in range(8)))
    writer = subprocess.Popen([sys.executable, "-c", PAUSING_WRITER, str(raw), str(root / "ckpt")], env=ENV_CLEAN)
    try:
        _, status = os.waitpid(writer.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        [d] = _staging(root)
        assert any((d / "data").iterdir()), "paused mid-write: some data is on disk"
        backdate(d, 30 * 86400)  # however old it looks
        before = snapshot(d)
        aggressive = ["--min-age", "0", "--older-than", "0s", "--preset", "miles", "--preset", "temp-shards"]
        for i in range(5):
            if i % 2:
                rc, out, _ = gc_proc(root, *aggressive, "--json")
                doc = json.loads(out)
            else:
                rc, doc = gc_json(root, *aggressive)
            assert rc == 0
            assert decisions(doc) == {d.name: "kept"}
            assert "lock held" in doc["candidates"][0]["reason"]
        rc, doc = gc_json(root, "--check", *aggressive)
        assert rc == 0 and doc["leaked"] == 0
        assert snapshot(d) == before
    finally:
        os.kill(writer.pid, signal.SIGCONT)
        rc = writer.wait(timeout=60)
    assert rc == 0
    assert _same(_load(root / "ckpt"), want)
    assert _staging(root) == []


@pytest.mark.parametrize("point, extra", [("shards-written", ()), ("write-chunk", ("--dtype", "bf16"))])
def test_killed_writer_is_removed_by_the_next_run_and_checkpoints_stay(ckpts, point, extra):
    root, src, old, new = ckpts
    p = _export(src, root / "dst", "--overwrite", *extra, env={"CKPTCTL_KILL_AT": point})
    assert p.returncode == -signal.SIGKILL, p.stderr
    [d] = _staging(root)
    owner = staging.read_owner(d)
    assert owner["dest"] == "dst" and "export" in owner["command"]
    published = snapshot(root / "dst")
    # dry run: lists it, removes nothing
    before = snapshot(root)
    rc, doc = gc_json(root, "--min-age", "0", "--dry-run")
    assert rc == 0 and decisions(doc) == {d.name: "would-remove"} and snapshot(root) == before
    assert doc["bytes_to_free"] > 0
    # past --older-than (and --min-age): gone, and the checkpoint is untouched
    backdate(d, 2 * 3600)
    rc, doc = gc_json(root)
    assert rc == 0 and decisions(doc) == {d.name: "removed"}
    assert doc["candidates"][0]["owner"]["host"] == socket.gethostname()
    assert not d.exists() and snapshot(root / "dst") == published
    assert _same(_load(root / "dst"), old) and (root / "dst" / "README.md").read_text() == "mine"
    # and the next export works as if nothing happened
    assert _export(src, root / "dst", "--overwrite").returncode == 0
    assert _same(_load(root / "dst"), new)


def test_killed_writer_on_another_host_waits_for_older_than(ckpts):
    root, src, old, _ = ckpts
    p = _export(src, root / "dst", "--overwrite", env={"CKPTCTL_KILL_AT": "shards-written"})
    assert p.returncode == -signal.SIGKILL
    [d] = _staging(root)
    record = json.loads((d / staging.OWNER).read_text())
    record["host"] = "node-17.invalid"  # as if the writer had run on another node of a shared filesystem
    (d / staging.OWNER).write_text(json.dumps(record))
    rc, doc = gc_json(root, "--min-age", "0")
    assert decisions(doc) == {d.name: "kept"} and "node-17.invalid" in doc["candidates"][0]["reason"]
    backdate(d, 3 * 3600)
    rc, doc = gc_json(root, "--older-than", "2h")
    assert decisions(doc) == {d.name: "removed"}
    assert _same(_load(root / "dst"), old)


@pytest.mark.parametrize("ready", [True, False])
def test_half_done_two_rename_publish_is_rolled_forward_or_back(ckpts, ready):
    root, src, old, new = ckpts
    env = {"CKPTCTL_FAIL_AT": "exchange:EINVAL", "CKPTCTL_KILL_AT": "two-rename-between"}
    p = _export(src, root / "dst", "--overwrite", env=env)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not (root / "dst").exists()  # the dangerous moment: the checkpoint is only inside staging
    [d] = _staging(root)
    assert (d / staging.OLD).is_dir()
    if not ready:
        (d / staging.READY).unlink()  # as if data/ had not been sealed: must roll back
    rc, doc = gc_json(root, "--min-age", "0", "--dry-run")
    want = "roll-forward" if ready else "roll-back"
    assert doc["candidates"][0]["recovery"] == want and not (root / "dst").exists()
    rc, doc = gc_json(root, "--min-age", "0")
    assert rc == 0 and decisions(doc) == {d.name: "removed"}
    assert doc["candidates"][0]["recovery"] == ("rolled-forward" if ready else "rolled-back")
    assert not d.exists()
    assert _same(_load(root / "dst"), new if ready else old)
    assert (root / "dst" / "README.md").read_text() == "mine"


def test_symlink_in_a_leaked_directory_leaves_its_target_intact(ckpts, tmp_path):
    root, src, old, _ = ckpts
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "precious.bin").write_bytes(b"precious")
    (outside / "dir" / "also.bin").write_bytes(b"also")
    p = _export(src, root / "dst", "--overwrite", env={"CKPTCTL_KILL_AT": "shards-written"})
    assert p.returncode == -signal.SIGKILL
    [d] = _staging(root)
    (d / "data" / "link.bin").symlink_to(outside / "precious.bin")
    (d / "data" / "linkdir").symlink_to(outside / "dir")
    (d / "data" / "up").symlink_to("../../..")
    before = snapshot(outside)
    rc, doc = gc_json(root, "--min-age", "0")
    assert rc == 0 and decisions(doc) == {d.name: "removed"} and not d.exists()
    assert snapshot(outside) == before
    assert _same(_load(root / "dst"), old)


def test_root_holding_checkpoints_loses_nothing_but_staging(ckpts, tmp_path, dead_pid):
    root, src, old, new = ckpts
    assert _export(src, root / "sharded").returncode == 0  # model-0000X-of-0000N.safetensors + index
    assert _export(src, root / "runs" / "step_1" / "hf", "--manifest").returncode == 0
    p = _export(src, root / "dst", "--overwrite", "--dtype", "bf16", env={"CKPTCTL_KILL_AT": "write-chunk"})
    assert p.returncode == -signal.SIGKILL
    other = make_dead(root / "runs" / "step_1", "hf", dead_pid)
    leaked = set(_staging(root)) | {other}
    backdate(root, 30 * 86400)  # everything looks ancient
    keep = {k: v for k, v in snapshot(root).items()
            if not any(k == str(p.relative_to(root)) or k.startswith(str(p.relative_to(root)) + "/") for p in leaked)}
    assert any("-of-" in k for k in keep)
    presets = [a for p in ("temp-shards", "safetensors-tmp", "incomplete", "orbax", "trainer-tmp")
               for a in ("--preset", p)]
    rc, doc = gc_json(root, *presets, "--older-than", "0s", "--min-age", "0")
    assert rc == 0 and {Path(c["path"]) for c in doc["candidates"]} == leaked
    assert doc["removed"] == len(leaked)
    assert snapshot(root) == keep
    assert _same(_load(root / "dst"), old) and _same(_load(root / "sharded"), new)


def test_two_overlapping_gc_runs_remove_each_directory_once(tmp_path, dead_pid):
    root = tmp_path / "root"
    dirs = [make_dead(root / f"run{i % 4}", f"ckpt{i}", dead_pid, payload=1000 + i) for i in range(24)]
    total = sum((d / "data" / "model.safetensors").stat().st_size + (d / staging.OWNER).stat().st_size for d in dirs)
    procs = [gc_proc(root, "--min-age", "0", "--json", wait=False) for _ in range(3)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    assert not any(d.exists() for d in dirs)
    assert all(doc["errors"] == [] for doc in docs)
    removed = [c["path"] for doc in docs for c in doc["candidates"] if c["decision"] == "removed"]
    assert set(removed) == {str(d) for d in dirs}
    assert sum(doc["bytes_freed"] for doc in docs) == total  # every byte freed counted exactly once
    for doc in docs:
        for c in doc["candidates"]:
            assert c["decision"] in ("removed", "vanished", "kept"), c


def test_a_directory_appearing_in_the_two_rename_window_is_kept_and_reported(ckpts):
    """Between the writer's two renames someone creates the destination: the second rename fails
    (ENOTEMPTY), the writer deletes neither version, and gc-tmp keeps the directory and reports it
    (exit 3) until the intruder is moved aside; then it rolls the new version forward."""
    root, src, old, new = ckpts
    env = {**ENV_CLEAN, "CKPTCTL_FAIL_AT": "exchange:EINVAL", "CKPTCTL_STOP_AT": "two-rename-between"}
    w = subprocess.Popen([sys.executable, "-m", "ckptctl", "export", str(src), str(root / "dst"), "--overwrite",
                          "--max-shard-size", "20KB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        wait_stopped(w.pid)
        (root / "dst").mkdir()
        (root / "dst" / "notes.txt").write_text("someone else's")
    finally:
        os.kill(w.pid, signal.SIGCONT)
    _, err = w.communicate(timeout=120)
    assert w.returncode == 3 and "nothing was deleted" in err, err
    [d] = _staging(root)
    assert _same(_load(d / staging.OLD), old) and _same(_load(d / staging.DATA), new)
    rc, doc = gc_json(root, "--min-age", "0")
    [c] = doc["candidates"]
    assert rc == 3 and c["decision"] == "kept" and c["error"].startswith("needs a human") and d.exists()
    assert os.listdir(root / "dst") == ["notes.txt"]
    os.rename(root / "dst", root / "notes")
    rc, doc = gc_json(root, "--min-age", "0")
    assert rc == 0 and decisions(doc) == {d.name: "removed"} and doc["candidates"][0]["recovery"] == "rolled-forward"
    assert _same(_load(root / "dst"), new) and (root / "dst" / "README.md").read_text() == "mine"
