"""gc-tmp on real directory trees: liveness verdicts, foreign presets, safety rules, CLI contract.

Staging directories here are made the way ``Stage.create`` makes them (name, lock, owner record,
data/) with owners that are really dead, really alive, on another host, or from another boot.
Writers that are real processes (paused, killed, half-published) are in test_gc_processes.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ckptctl import gc, staging
from ckptctl.cli.gc_cmd import gc_tmp
from tests.support import drop_dac_caps as _drop_dac_caps
from tests.support import run_ckptctl, snapshot

# ---------------------------------------------------------------------------------------------
# helpers (imported by test_gc_processes.py)

GC_SCRIPT = ("import sys, typer; from ckptctl.cli.gc_cmd import gc_tmp; app = typer.Typer(); "
             "app.command('gc-tmp')(gc_tmp); app()")


def _app() -> typer.Typer:
    app = typer.Typer(rich_markup_mode=None, pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """test app"""

    app.command("gc-tmp")(gc_tmp)
    return app


def gc_cli(*args: object, env: dict | None = None):
    """In-process: ``gc-tmp ARGS`` -> click Result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(_app(), ["gc-tmp", *map(str, args)], env=env)


def gc_json(*args: object) -> tuple[int, dict]:
    r = gc_cli(*args, "--json")
    return r.exit_code, json.loads(r.stdout)


def gc_proc(*args: object, wait: bool = True, no_dac: bool = False):
    """``gc-tmp ARGS`` in a real process; returns Popen, or (rc, stdout, stderr) when ``wait``.
    ``no_dac``: as root, without the capabilities that bypass file permissions."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTCTL_")}
    pre = _drop_dac_caps if no_dac and os.geteuid() == 0 else None
    p = subprocess.Popen([sys.executable, "-c", GC_SCRIPT, *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, preexec_fn=pre)
    if not wait:
        return p
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


@pytest.fixture(scope="session")
def dead_pid() -> tuple[int, int]:
    """(pid, start time) of a process that has exited and been reaped."""
    p = subprocess.Popen(["sleep", "60"])
    start = staging.process_start_time(p.pid)
    p.kill()
    p.wait()
    assert start is not None
    return p.pid, start


def make_staging(parent: Path, dest: str, *, payload: int = 4096, lock: bool = True, **owner) -> Path:
    """A staging directory as Stage.create leaves it, owner fields overridden by ``owner``."""
    parent.mkdir(parents=True, exist_ok=True)
    d = parent / staging.staging_name(dest)
    d.mkdir()
    if lock:
        (d / staging.LOCK).touch()
    record = staging.owner_record(parent / dest, "test")
    record.update(owner)
    (d / staging.OWNER).write_text(json.dumps(record))
    (d / staging.DATA).mkdir()
    (d / staging.DATA / "model.safetensors").write_bytes(os.urandom(payload))
    return d


def make_dead(parent: Path, dest: str, dead_pid: tuple[int, int], **kw) -> Path:
    return make_staging(parent, dest, pid=dead_pid[0], start_time=dead_pid[1], **kw)


def backdate(path: Path, seconds: float) -> None:
    """Move every mtime in the tree ``seconds`` into the past (no link followed)."""
    paths = [path]
    if path.is_dir() and not path.is_symlink():
        paths += list(path.rglob("*"))
    for p in paths:
        st = os.lstat(p)
        os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds), follow_symlinks=False)


def decisions(doc: dict) -> dict[str, str]:
    return {Path(c["path"]).name: c["decision"] for c in doc["candidates"]}


# ---------------------------------------------------------------------------------------------
# liveness of ckptctl staging


def test_dead_same_host_writer_is_removed_regardless_of_age(tmp_path, dead_pid):
    d = make_dead(tmp_path, "ckpt", dead_pid, payload=10_000)
    owner_size = (d / staging.OWNER).stat().st_size
    rc, doc = gc_json(tmp_path, "--min-age", "0")
    assert rc == 0 and doc["ok"]
    [c] = doc["candidates"]
    assert c["kind"] == "ours" and c["decision"] == "removed" and "is gone" in c["reason"]
    assert c["owner"]["pid"] == dead_pid[0]
    assert doc["bytes_freed"] == c["bytes_freed"] == 10_000 + owner_size
    assert not d.exists()


def test_bytes_freed_counts_each_inode_once_and_not_shared_links(tmp_path, dead_pid):
    d = make_dead(tmp_path, "ckpt", dead_pid, payload=5000)
    outside = tmp_path / "published.bin"
    outside.write_bytes(b"p" * 7000)
    os.link(outside, d / "data" / "carried.bin")  # carried over by hard link: removing it frees nothing
    os.link(d / "data" / "model.safetensors", d / "data" / "alias.safetensors")  # both links inside
    owner_size = (d / staging.OWNER).stat().st_size
    rc, doc = gc_json(tmp_path, "--min-age", "0")
    assert rc == 0
    [c] = doc["candidates"]
    assert c["size"] == 5000 + 7000 + owner_size
    assert c["bytes_freed"] == doc["bytes_freed"] == 5000 + owner_size
    assert outside.read_bytes() == b"p" * 7000


def test_min_age_protects_a_just_dead_writer(tmp_path, dead_pid):
    d = make_dead(tmp_path, "ckpt", dead_pid)
    rc, doc = gc_json(tmp_path)  # default --min-age 60s
    assert rc == 0 and decisions(doc) == {d.name: "kept"} and "--min-age" in doc["candidates"][0]["reason"]
    backdate(d, 120)
    rc, doc = gc_json(tmp_path)
    assert decisions(doc) == {d.name: "removed"} and not d.exists()


def test_live_pid_with_free_lock_is_kept(tmp_path):
    # our own pid and start time: the process is alive even though nobody holds the lock
    d = make_staging(tmp_path, "ckpt")
    backdate(d, 10 * 86400)
    rc, doc = gc_json(tmp_path, "--min-age", "0", "--older-than", "0s")
    assert rc == 0 and decisions(doc) == {d.name: "kept"}
    assert "still running" in doc["candidates"][0]["reason"]
    assert d.exists()


def test_held_lock_is_kept_whatever_the_age(tmp_path, dead_pid):
    d = make_dead(tmp_path, "ckpt", dead_pid)
    backdate(d, 10 * 86400)
    lock = staging.acquire(d)
    try:
        for _ in range(3):
            rc, doc = gc_json(tmp_path, "--min-age", "0", "--older-than", "0s", "--preset", "miles")
            assert rc == 0 and decisions(doc) == {d.name: "kept"} and "lock held" in doc["candidates"][0]["reason"]
    finally:
        lock.release()
    rc, doc = gc_json(tmp_path, "--min-age", "0")
    assert decisions(doc) == {d.name: "removed"}


def test_reused_pid_and_other_boot_are_dead(tmp_path):
    me = os.getpid()
    reused = make_staging(tmp_path, "a", pid=me, start_time=staging.process_start_time(me) - 1)
    rebooted = make_staging(tmp_path, "b", pid=me, boot_id="00000000-0000-0000-0000-000000000000")
    rc, doc = gc_json(tmp_path, "--min-age", "0")
    assert rc == 0
    assert decisions(doc) == {reused.name: "removed", rebooted.name: "removed"}
    reasons = {Path(c["path"]).name: c["reason"] for c in doc["candidates"]}
    assert "another process" in reasons[reused.name] and "reboot" in reasons[rebooted.name]


def test_zombie_writer_is_dead(tmp_path):
    z = subprocess.Popen(["true"])
    try:
        for _ in range(1000):  # wait until it has exited (it stays a zombie: not reaped yet)
            if staging.process_state(z.pid) == "Z":
                break
            os.sched_yield()
        assert staging.process_state(z.pid) == "Z"
        d = make_staging(tmp_path, "ckpt", pid=z.pid, start_time=staging.process_start_time(z.pid))
        rc, doc = gc_json(tmp_path, "--min-age", "0")
        assert decisions(doc) == {d.name: "removed"} and "zombie" in doc["candidates"][0]["reason"]
    finally:
        z.wait()


def test_other_host_is_judged_by_lock_and_older_than(tmp_path):
    d = make_staging(tmp_path, "ckpt", host="elsewhere.invalid", pid=1)
    rc, doc = gc_json(tmp_path, "--min-age", "0")
    assert decisions(doc) == {d.name: "kept"} and "elsewhere.invalid" in doc["candidates"][0]["reason"]
    backdate(d, 2 * 3600)
    rc, doc = gc_json(tmp_path, "--older-than", "6h")
    assert decisions(doc) == {d.name: "kept"}
    rc, doc = gc_json(tmp_path)  # default --older-than 1h
    assert decisions(doc) == {d.name: "removed"} and not d.exists()


def test_staging_without_owner_record_is_not_ours(tmp_path):
    d = tmp_path / staging.staging_name("ckpt")
    (d / "data").mkdir(parents=True)
    (d / "data" / "weights.bin").write_bytes(b"w" * 100)
    backdate(d, 10 * 86400)
    rc, doc = gc_json(tmp_path, "--min-age", "0", "--older-than", "0s")
    assert rc == 0 and decisions(doc) == {d.name: "kept"}
    assert doc["candidates"][0]["kind"] == "unknown" and doc["leaked"] == 0
    rc, doc = gc_json(tmp_path, "--preset", "miles")  # opt in: judged by age only
    [c] = doc["candidates"]
    assert c["kind"] == "foreign" and c["match"] == "miles" and c["decision"] == "removed"
    assert "judged by age only" in c["reason"]


def test_empty_stub_goes_once_older_than_min_age(tmp_path):
    d = tmp_path / staging.staging_name("ckpt")  # writer killed between mkdir and its owner record
    d.mkdir()
    (d / staging.LOCK).touch()
    rc, doc = gc_json(tmp_path)
    assert decisions(doc) == {d.name: "kept"} and "min-age" in doc["candidates"][0]["reason"]
    backdate(d, 120)
    rc, doc = gc_json(tmp_path)
    assert decisions(doc) == {d.name: "removed"} and not d.exists()


# ---------------------------------------------------------------------------------------------
# foreign presets and patterns


def test_foreign_presets_match_by_name_and_age_only(tmp_path):
    ck = tmp_path / "run" / "step_100"
    ck.mkdir(parents=True)
    real = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "config.json", ".tmp_notes", "tmp.txt"]
    for n in real:
        (ck / n).write_bytes(b"r")
    leaks = {
        ck / "model-00003-of-?????.safetensors": "temp-shards",
        ck / ".tmpa1B2c3": "safetensors-tmp",
        tmp_path / "run" / "step_200.orbax-checkpoint-tmp-1700000000": "orbax",
        tmp_path / "hub" / "blobs" / "abc123.incomplete": "incomplete",
        tmp_path / "run" / "tmp-checkpoint-300": "trainer-tmp",
        tmp_path / "run" / "export.partial": "pattern *.partial",
    }
    for p, kind in leaks.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        if kind in ("orbax", "trainer-tmp"):
            (p / "sub").mkdir(parents=True)
            (p / "sub" / "f").write_bytes(b"x" * 10)
        else:
            p.write_bytes(b"x" * 10)
    lonely = tmp_path / "other" / ".tmpzzzzzz"  # no shard beside it: not safetensors' temp file
    lonely.parent.mkdir()
    lonely.write_bytes(b"x")
    backdate(tmp_path, 3 * 3600)
    presets = [a for p in gc.PRESETS for a in ("--preset", p)]
    rc, doc = gc_json(tmp_path, *presets, "--pattern", "*.partial", "--dry-run")
    assert rc == 0
    got = {Path(c["path"]): (c["match"], c["decision"]) for c in doc["candidates"]}
    assert got == {p: (kind.replace("pattern *.partial", "pattern *.partial"), "would-remove") for p, kind in leaks.items()}
    for c in doc["candidates"]:
        assert c["kind"] == "foreign" and "judged by age only" in c["reason"] and c["owner"] is None
    rc, doc = gc_json(tmp_path, *presets, "--pattern", "*.partial")
    assert doc["removed"] == len(leaks) and doc["bytes_freed"] == 10 * len(leaks)
    assert sorted(os.listdir(ck)) == sorted(real) and lonely.exists()


def test_young_foreign_entries_are_kept(tmp_path):
    (tmp_path / "a.incomplete").write_bytes(b"x")
    rc, doc = gc_json(tmp_path, "--preset", "incomplete", "--min-age", "0")
    assert decisions(doc) == {"a.incomplete": "kept"} and "(< 1h00m)" in doc["candidates"][0]["reason"]
    rc, doc = gc_json(tmp_path, "--preset", "incomplete", "--older-than", "30m", "--min-age", "0")
    assert decisions(doc) == {"a.incomplete": "kept"}


def test_foreign_dir_with_a_held_lock_is_kept(tmp_path):
    d = tmp_path / "_tmp_miles_export"
    d.mkdir()
    lock = staging.acquire(d)
    try:
        backdate(d, 86400)
        rc, doc = gc_json(tmp_path, "--preset", "miles")
        assert decisions(doc) == {d.name: "kept"} and "holds its lock" in doc["candidates"][0]["reason"]
    finally:
        lock.release()


def test_foreign_dir_holding_a_live_writers_staging_is_kept(tmp_path, dead_pid):
    run = tmp_path / "exp.partial"
    live = make_dead(run / "out", "ckpt", dead_pid)  # dead by pid, but its lock is held: alive
    lock = staging.acquire(live)
    try:
        backdate(tmp_path, 86400)
        rc, doc = gc_json(tmp_path, "--pattern", "*.partial", "--min-age", "0", "--older-than", "0s")
        assert decisions(doc) == {run.name: "kept"} and "live ckptctl writer" in doc["candidates"][0]["reason"]
    finally:
        lock.release()
    rc, doc = gc_json(tmp_path, "--pattern", "*.partial")
    assert decisions(doc) == {run.name: "removed"} and not run.exists()


@pytest.mark.parametrize("bad", ["*", "?*", "a/*.tmp", "[!]*"])
def test_patterns_that_match_everything_or_paths_are_refused(tmp_path, bad):
    r = gc_cli(tmp_path, "--pattern", bad)
    assert r.exit_code == 2 and "error:" in r.stderr and "hint:" in r.stderr and r.stdout == ""


def test_unknown_preset_and_bad_duration_are_usage_errors(tmp_path):
    r = run_ckptctl("gc-tmp", tmp_path, "--preset", "nope", "--json")  # Typer checks a choice: ckptctl.cli.main
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "usage"
    assert "--preset: 'nope' is not one of" in r.stderr
    r = gc_cli(tmp_path, "--older-than", "soon")
    assert r.exit_code == 2 and "--older-than" in r.stderr
    for ok in ("30m", "6h", "2d", "90"):
        assert gc_cli(tmp_path, "--older-than", ok).exit_code == 0


# ---------------------------------------------------------------------------------------------
# safety


def test_refuses_filesystem_root_and_home(tmp_path):
    r = gc_cli("/", "--json")
    assert r.exit_code == 2 and "filesystem root" in json.loads(r.stdout)["error"]["message"]
    home = tmp_path / "home"
    home.mkdir()
    r = gc_cli(home, env={"HOME": str(home)})
    assert r.exit_code == 2 and "home directory" in r.stderr
    link = tmp_path / "h"
    link.symlink_to(home)  # the same directory by another name
    assert gc_cli(link, env={"HOME": str(home)}).exit_code == 2
    assert gc_cli(tmp_path / "missing").exit_code == 2
    (tmp_path / "f").write_text("x")
    assert gc_cli(tmp_path / "f").exit_code == 2


def test_symlinked_directories_are_not_followed(tmp_path, dead_pid):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    victim = make_dead(outside, "ckpt", dead_pid)
    (outside / "x.incomplete").write_text("x")
    backdate(outside, 86400)
    (root / "linked").symlink_to(outside)
    before = snapshot(outside)
    rc, doc = gc_json(root, "--min-age", "0", "--older-than", "0s", "--preset", "incomplete")
    assert rc == 0 and doc["candidates"] == []
    assert snapshot(outside) == before and victim.exists()


def test_matching_symlink_is_removed_as_a_link(tmp_path):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep")
    root = tmp_path / "root"
    root.mkdir()
    (root / "weights.incomplete").symlink_to(target)
    (root / "model-00001-of-?????.safetensors").symlink_to(tmp_path)  # a file-kind name, linked to a directory
    # a link is not a directory: a directory-kind preset (orbax) does not take it
    (root / "step_1.orbax-checkpoint-tmp-1700000000").symlink_to(tmp_path)
    before = snapshot(tmp_path)
    backdate(root, 86400)
    rc, doc = gc_json(root, "--preset", "incomplete", "--preset", "temp-shards", "--preset", "orbax")
    assert rc == 0 and doc["removed"] == 2
    assert decisions(doc) == {"weights.incomplete": "removed", "model-00001-of-?????.safetensors": "removed"}
    assert os.listdir(root) == ["step_1.orbax-checkpoint-tmp-1700000000"] and target.read_bytes() == b"keep"
    after = snapshot(tmp_path)
    assert {k: v for k, v in before.items() if not k.startswith("root/")} == \
        {k: v for k, v in after.items() if not k.startswith("root/")}


def test_max_depth_bounds_the_scan(tmp_path, dead_pid):
    deep = make_dead(tmp_path / "a" / "b", "ckpt", dead_pid)  # depth 3
    rc, doc = gc_json(tmp_path, "--min-age", "0", "--max-depth", "2")
    assert doc["candidates"] == [] and deep.exists()
    rc, doc = gc_json(tmp_path, "--min-age", "0", "--max-depth", "3")
    assert decisions(doc) == {deep.name: "removed"}
    assert gc_cli(tmp_path, "--max-depth", "0").exit_code == 2


def test_does_not_descend_into_a_staging_directory(tmp_path, dead_pid):
    d = make_staging(tmp_path, "ckpt")  # alive (our pid): kept, and nothing inside it is touched
    inner = d / "data" / "x.incomplete"
    inner.write_text("x")
    backdate(tmp_path, 86400)
    rc, doc = gc_json(tmp_path, "--preset", "incomplete", "--min-age", "0", "--older-than", "0s")
    assert decisions(doc) == {d.name: "kept"} and inner.exists()


def test_overlapping_roots_are_handled_once(tmp_path, dead_pid):
    d = make_dead(tmp_path / "a", "ckpt", dead_pid)
    rc, doc = gc_json(tmp_path, tmp_path / "a", tmp_path, "--min-age", "0")
    assert rc == 0 and doc["removed"] == 1 and not d.exists()


def test_permission_error_on_one_entry_is_reported_and_the_rest_goes(tmp_path, dead_pid):
    """Exit 3 at the end; everything else was handled. As root, gc runs without the capabilities
    that bypass file permissions, and the unreadable parts belong to nobody."""
    as_root = os.geteuid() == 0
    root = tmp_path / "root"
    good = make_dead(root / "ok", "ckpt", dead_pid)
    closed = root / "closed"
    hidden = make_dead(closed / "inner", "ckpt", dead_pid)
    stuck = make_dead(root / "stuck", "ckpt", dead_pid)
    ro_data = stuck / staging.DATA
    try:
        if as_root:
            os.chown(closed, 65534, 65534)
            os.chown(ro_data, 65534, 65534)
        os.chmod(closed, 0o700 if as_root else 0o000)
        os.chmod(ro_data, 0o555)
        rc, out, err = gc_proc(root, "--min-age", "0", "--json", no_dac=True)
        doc = json.loads(out)
        assert rc == 3 and doc["ok"] is False, err
        got = decisions(doc)
        assert got == {good.name: "removed", stuck.name: "failed"} and not good.exists()
        errors = {e["path"]: e["message"] for e in doc["errors"]}
        assert set(errors) == {str(closed), str(stuck)}
        assert "Permission denied" in errors[str(closed)] and "Permission denied" in errors[str(stuck)]
        assert err.count("error:") == 2 and "hint:" in err
        assert hidden.exists() and (stuck / staging.OWNER).exists()  # still recognisable as ours
    finally:
        os.chmod(closed, 0o755)
        os.chmod(ro_data, 0o755)
    rc, doc = gc_json(root, "--min-age", "0")  # once fixed, the next run finishes the job
    assert rc == 0 and set(decisions(doc)) == {hidden.name, stuck.name} and doc["removed"] == 2


# ---------------------------------------------------------------------------------------------
# CLI contract


def test_dry_run_and_check_remove_nothing(tmp_path, dead_pid):
    d = make_dead(tmp_path / "x", "ckpt", dead_pid)
    (tmp_path / "y.incomplete").write_text("y")
    backdate(tmp_path, 86400)
    before = snapshot(tmp_path)
    r = gc_cli(tmp_path, "--preset", "incomplete", "--preset", "miles", "--min-age", "0", "--dry-run")
    assert r.exit_code == 0 and "would remove" in r.stdout and snapshot(tmp_path) == before
    r = gc_cli(tmp_path, "--preset", "incomplete", "--check")
    assert r.exit_code == 1 and snapshot(tmp_path) == before and "hint:" in r.stderr
    rc, doc = gc_json(tmp_path, "--preset", "incomplete", "--check")
    assert rc == 1 and doc["ok"] is False and doc["leaked"] == 2 and doc["removed"] == 0
    assert snapshot(tmp_path) == before
    assert gc_cli(tmp_path, "--preset", "incomplete").exit_code == 0
    assert not d.exists()
    r = gc_cli(tmp_path, "--preset", "incomplete", "--check")
    assert r.exit_code == 0 and "nothing to clean up" in r.stdout


def test_table_on_stdout_shows_path_owner_age_size_decision(tmp_path, dead_pid):
    d = make_dead(tmp_path, "ckpt", dead_pid, payload=2_000_000)
    backdate(d, 7200)
    r = gc_cli(tmp_path)
    assert r.exit_code == 0
    out = r.stdout
    for word in ("path", "owner", "age", "size", "decision", d.name, f"pid {dead_pid[0]} @ {socket.gethostname()}",
                 "2h00m", "2.00 MB", "removed", "freed 2.00 MB"):
        assert word in out, word
    assert r.stderr == ""


def test_json_is_one_document_with_integer_sizes(tmp_path, dead_pid):
    make_dead(tmp_path, "ckpt", dead_pid, payload=1234)
    r = gc_cli(tmp_path, "--min-age", "0", "--json", "-v")
    doc = json.loads(r.stdout)  # exactly one document, nothing else on stdout
    assert doc["schema_version"] == 1 and doc["command"] == "gc-tmp" and doc["ok"] is True
    assert isinstance(doc["bytes_freed"], int) and doc["bytes_freed"] > 1234
    assert doc["options"]["min_age_seconds"] == 0 and doc["entries_scanned"] >= 1


def test_gc_tmp_does_not_import_torch(tmp_path, dead_pid):
    make_dead(tmp_path, "ckpt", dead_pid)
    script = ("import sys, typer\nfrom ckptctl.cli.gc_cmd import gc_tmp\napp = typer.Typer()\n"
              "app.command('gc-tmp')(gc_tmp)\ntry:\n    app()\nfinally:\n"
              "    print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path), "--min-age", "0"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().endswith("NO-TORCH")
