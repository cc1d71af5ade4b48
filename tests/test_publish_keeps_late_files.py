"""What a running job writes into a destination's subdirectories while an export or resave
replaces it is kept (issue 33, hardening round 3; DESIGN I3), on real files and real processes.

Before, only the destination's top level was compared at publish time: ``logs/events.2`` written
by a trainer, ``docs/notes.md`` saved by an editor's rename, a new ``logs/tb/`` folder were in the
old version only, and were deleted with it (exit 0). Now the destination is listed at every depth
when the plan is made, and whatever is new or replaced below it when the new version is published
is moved into the new version at the same path; a late file of a weights family the new version
writes in that folder is kept beside it as ``<name>.ckptctl-kept`` (a loader never picks it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support import (clean_env, load_glob, load_hub, load_single_first, popen_ckptctl, run_ckptctl, same,
                          staging_dirs, state, wait_stopped, write_new_version, write_single)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_new_version(tmp_path / "src")


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    """The previous version (4 shards and an index: what the new version drops), with a run's
    folders at several depths."""
    write_single(tmp_path / "v1", state(1, n=4))
    run_ckptctl("export", tmp_path / "v1", tmp_path / "ckpt", "--max-shard-size", "10KB", check=True)
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    d = tmp_path / "ckpt"
    (d / "logs").mkdir()
    (d / "logs" / "events.1").write_text("step 1\n")
    (d / "docs" / "deep").mkdir(parents=True)
    (d / "docs" / "notes.md").write_text("v1 notes")
    (d / "docs" / "deep" / "a.txt").write_text("a")
    return d


# the concurrent writer: a trainer and an editor working in the destination's subfolders
WRITER = r"""
import os, sys
from safetensors.torch import save_file
import torch
dest = sys.argv[1]
def put(rel, text):
    with open(os.path.join(dest, rel), "w") as f:
        f.write(text)
put("logs/events.2", "step 2\n")                        # a new file in a folder that was there
with open(os.path.join(dest, "logs/events.1"), "a") as f:  # appended in place (same inode)
    f.write("step 1b\n")
put("docs/notes.md.tmp", "v2 notes")                      # an editor's atomic save, one level down
os.rename(os.path.join(dest, "docs/notes.md.tmp"), os.path.join(dest, "docs/notes.md"))
put("docs/deep/b.txt", "b")                               # two levels down
put("docs/deep/a.txt.tmp", "a2")                          # replaced by rename, two levels down
os.rename(os.path.join(dest, "docs/deep/a.txt.tmp"), os.path.join(dest, "docs/deep/a.txt"))
os.mkdir(os.path.join(dest, "logs/tb"))                   # a new folder inside a folder that was there
put("logs/tb/ev.0", "tb")
os.makedirs(os.path.join(dest, "runs/r1"))                # a new tree at the top
put("runs/r1/metrics.json", '{"loss": 1.5}')
# a stale shard of the model's own family: never carried in under a name a loader picks
save_file({f"layers.{i}.weight": torch.full((2, 2), 9.0) for i in range(4)},
          os.path.join(dest, "model-00001-of-00002.safetensors"))
"""

EXPECTED = {
    "logs/events.1": "step 1\nstep 1b\n",
    "logs/events.2": "step 2\n",
    "docs/notes.md": "v2 notes",
    "docs/deep/a.txt": "a2",
    "docs/deep/b.txt": "b",
    "logs/tb/ev.0": "tb",
    "runs/r1/metrics.json": '{"loss": 1.5}',
    "README.md": "v1 notes",
}


# shard-start: the shards are being written; extras-written: the destination's files were just
# linked into the new version; sealed: the new version is complete and marked ready. Six cases
# cover every pair of (command, publish, stop) values (all twelve took 50 s of the suite).
PAIRWISE = [("export", True, "shard-start"), ("resave", False, "shard-start"), ("export", False, "extras-written"),
            ("resave", True, "extras-written"), ("export", False, "sealed"), ("resave", True, "sealed")]


@pytest.mark.parametrize("command,exchange,stop", PAIRWISE,
                         ids=[f"{c}-{'exchange' if x else 'two-rename'}-{s}" for c, x, s in PAIRWISE])
def test_changes_at_every_depth_while_the_new_version_is_written_are_kept(src, dest, tmp_path, exchange, stop,
                                                                          command):
    (dest / "README.md").write_text("v1 notes")
    env = {"CKPTCTL_STOP_AT": stop}
    if not exchange:
        env["CKPTCTL_FAIL_AT"] = "exchange:EINVAL"  # the NFS path: two journaled renames
    if command == "export":
        proc = popen_ckptctl("export", src, dest, "--overwrite", "--json", env=env)
        tensors = state(7, n=4)
    else:
        # one output shard, so the stop point is met once (resave --dtype alone keeps each shard)
        proc = popen_ckptctl("resave", dest, "--dtype", "bf16", "--max-shard-size", "5GB", "--json", env=env)
        tensors = {k: v.bfloat16() for k, v in state(1, n=4).items()}
    wait_stopped(proc.pid)
    w = subprocess.run([sys.executable, "-c", WRITER, str(dest)], env=clean_env(), timeout=60, capture_output=True)
    assert w.returncode == 0, w.stderr
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    for rel, text in EXPECTED.items():
        assert (dest / rel).read_text() == text, rel
    # the stale shard is kept, under a name no loader picks
    stale = dest / "model-00001-of-00002.safetensors.ckptctl-kept"
    assert load_file(str(stale))["layers.0.weight"][0, 0].item() == 9.0
    assert not (dest / "model-00001-of-00002.safetensors").exists()
    for load in (load_glob, load_hub, load_single_first):
        assert same(load(dest), tensors), load.__name__
    carried = set(doc["carried"])  # each kept path, or the folder it came with, is reported
    for rel in ("logs/events.2", "docs/notes.md", "docs/deep/b.txt", "docs/deep/a.txt", "logs/tb/ev.0", "runs/r1"):
        parts = rel.split("/")
        assert any("/".join(parts[:i]) in carried for i in range(1, len(parts) + 1)), (rel, carried)
    if stop != "shard-start":  # after the destination's folders were linked: carried at publish, one by one
        assert {"logs/events.2", "docs/notes.md", "docs/deep/b.txt", "docs/deep/a.txt", "logs/tb"} <= carried, carried
    assert staging_dirs(tmp_path) == []
    assert run_ckptctl("verify", dest).returncode == 0


# a trainer and an editor writing without pause while exports replace the directory
RACER = r"""
import os, sys, time
dest, journal, stop = sys.argv[1], sys.argv[2], sys.argv[3]
i = 0
with open(journal, "a") as log:
    while not os.path.exists(stop):
        i += 1
        try:
            fd = os.open(os.path.join(dest, "logs", f"e.{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, f"{i}".encode())
            os.close(fd)
            log.write(f"logs/e.{i} {i}\n")
            if i % 3 == 0:
                tmp = os.path.join(dest, "docs", f".notes.{i}")
                with open(tmp, "w") as f:
                    f.write(f"v{i}")
                os.rename(tmp, os.path.join(dest, "docs", "notes.md"))
                log.write(f"docs/notes.md v{i}\n")
            if i % 5 == 0:
                os.mkdir(os.path.join(dest, "runs", f"r{i}"))
                with open(os.path.join(dest, "runs", f"r{i}", "m.json"), "w") as f:
                    f.write(f"{i}")
                log.write(f"runs/r{i}/m.json {i}\n")
        except FileNotFoundError:
            pass  # the instant of an exchange-less publish, or a folder not moved over yet
        log.flush()
        time.sleep(0.01)
"""


def race(src: Path, dest: Path, tmp_path: Path, trials: int) -> dict[str, int]:
    """``trials`` exports (exchange and two-rename alternately) while RACER writes; returns figures."""
    (dest / "runs").mkdir()
    journal, stop = tmp_path / "journal", tmp_path / "stop"
    racer = subprocess.Popen([sys.executable, "-c", RACER, str(dest), str(journal), str(stop)], env=clean_env())
    failures = []
    started = time.monotonic()
    try:
        time.sleep(0.2)
        for t in range(trials):
            env = {} if t % 2 == 0 else {"CKPTCTL_FAIL_AT": "exchange:EINVAL"}
            r = run_ckptctl("export", src, dest, "--overwrite", "-q", env=env)
            if r.returncode != 0:
                failures.append(r.stderr)
    finally:
        stop.write_text("")
        racer.wait(timeout=60)
    seconds = time.monotonic() - started
    want: dict[str, str] = {}
    for line in journal.read_text().splitlines():
        rel, _, text = line.partition(" ")
        want[rel] = text
    lost = [rel for rel, text in want.items() if not (dest / rel).is_file() or (dest / rel).read_text() != text]
    return {"trials": trials, "failed": len(failures), "written": len(want), "lost": len(lost),
            "seconds": round(seconds, 1), "examples": lost[:5], "errors": failures[:2]}


def test_a_writer_racing_exports_loses_nothing(src, dest, tmp_path):
    figures = race(src, dest, tmp_path, trials=int(os.environ.get("CKPTCTL_RACE_TRIALS", "6")))
    print(figures)
    assert figures["failed"] == 0 and figures["lost"] == 0, figures
    assert figures["written"] > 50
    assert same(load_glob(dest), state(7, n=4))
    assert staging_dirs(tmp_path) == []


def test_a_carried_file_replaced_while_it_is_linked_is_carried_as_it_is_now(tmp_path, monkeypatch):
    """Linux fails a link with ENOENT when the inode's last name went between the look-up and the
    link (a writer's rename over the file: what the racing writer above does to docs/notes.md).
    ``carry`` looks the name up again and brings the file now there; a name gone for good still
    fails the export (nothing published)."""
    import errno

    from ckptctl.write import job

    src, dst = tmp_path / "notes.md", tmp_path / "new" / "notes.md"
    src.write_text("v1")
    dst.parent.mkdir()
    real_link, calls = os.link, []

    def racing_link(a, b, *args, **kwargs):
        calls.append(str(a))
        if len(calls) == 1:  # the writer's save lands between the look-up and the link
            (tmp_path / ".notes.tmp").write_text("v2")
            os.rename(tmp_path / ".notes.tmp", src)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(a))
        return real_link(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "link", racing_link)
    job.carry(src, dst, fsync=False)
    assert dst.read_text() == "v2" and len(calls) == 2 and os.path.samefile(src, dst)
    with pytest.raises(FileNotFoundError):
        job.carry(tmp_path / "gone.md", tmp_path / "new" / "gone.md", fsync=False)
    assert not (tmp_path / "new" / "gone.md").exists()
