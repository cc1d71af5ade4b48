"""``export --follow --json``'s events against docs/schemas/export-follow.schema.json (every follow
test's events are validated by ``follow_helpers.parse_events``; here each kind a run can give
without a fault point, in one DST_ROOT), and ``--on-publish-timeout``: a hook that never ends is
killed with its whole process group, recorded ``timeout``, and following goes on."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.follow_helpers import event_validator, named, records, run_follow, start_follow
from tests.support.cli import communicate, process_state, run_ckptctl
from tests.test_follow_dcp import Loop


def _gone(pid: int, deadline_s: float = 60.0) -> bool:
    """``pid`` has exited (gone, or a zombie its new parent has not reaped yet). The deadline only
    bounds a failing test: a killed process is gone as soon as the kernel delivers SIGTERM."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process_state(pid) in (None, "Z"):
            return True
        time.sleep(0.01)
    return False


def test_a_hung_on_publish_is_killed_with_its_group_and_following_goes_on(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    for step in (1, 2):
        loop.save(step)
    pids = tmp_path / "pids"
    # the hook's shell starts a child that sleeps for ever and waits for it: only killing the
    # group ends the child (the shell alone dying would leave it running)
    hook = f"sh -c 'sleep 1000 & echo $! >> {pids}; wait' hook"
    rc, events, err = run_follow(run, dst, "--from", "all", "--on-publish", hook, "--on-publish-timeout", "2s")
    assert rc == 0, err
    assert named(events, "published") == ["step-1", "step-2"]
    hooks = [e for e in events if e["event"] == "hook"]
    assert [(e["name"], e["status"], e["exit_code"]) for e in hooks] == [("step-1", "timeout", None),
                                                                          ("step-2", "timeout", None)]
    for name in ("step-1", "step-2"):
        rec = records(dst)[name]["on_publish"]
        assert rec["status"] == "timeout" and rec["exit_code"] is None and "killed" in rec["error"]
        last = records(dst)[name]["events"][-1]
        assert (last["event"], last["status"]) == ("hook", "timeout")
    # each sleeper its shell lived to start is gone with the group (on a machine so busy that a shell
    # is killed before it starts its child there is no sleeper to outlive it: nothing to wait for)
    sleepers = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    assert len(sleepers) <= 2 and all(_gone(p) for p in sleepers)
    doc = json.loads(run_ckptctl("inspect", dst, "--json").stdout)
    assert [r["on_publish"] for r in doc["follow"]["saves"]] == ["timeout", "timeout"]


def test_on_publish_timeout_is_a_duration(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    for bad, says in (("soon", "--on-publish-timeout"), ("0", "must be positive")):
        p = run_ckptctl("export", tmp_path / "run", tmp_path / "hf", "--follow", "--once",
                        "--on-publish", "true", "--on-publish-timeout", bad)
        assert p.returncode == 2 and p.stderr.startswith("error: ") and says in p.stderr, p.stderr


def test_every_event_kind_of_a_plain_run_validates(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    loop.save(1)
    loop.save(2)
    seen: list[dict] = []

    def once(*extra: object, code: int = 0) -> list[dict]:
        rc, events, err = run_follow(run, dst, *extra)  # parse_events validates each document
        assert rc == code, err
        seen.extend(events)
        return events

    once("--on-publish", "true")  # start, skipped (step-1, --from newest), exporting, published, hook, done
    (loop.save(3) / ".metadata").unlink()
    once()  # waiting
    shutil.rmtree(run / "step-3")
    loop.save(4)
    (dst / "step-4").mkdir()  # a directory the follower did not publish
    once()  # lost (step-3), refused (step-4 blocked)
    shutil.rmtree(dst / "step-4")
    loop.save(5)
    once()
    (dst / "step-4" / "eval.json").write_text("{}")  # a user's file in an export of ours
    once("--keep-last", "1")  # released (step-4), removed (step-2)
    loop.save(6)
    proc = start_follow(run, dst, "--exit-when-idle", "0", once=False)
    out, err = communicate(proc, 300)
    assert proc.returncode == 0, err
    from tests.follow_helpers import parse_events

    seen.extend(parse_events(out))  # idle
    other = tmp_path / "other"
    other.mkdir()
    rc, events, err = run_follow(other, dst)  # another source into this DST_ROOT: the error document
    assert rc == 2 and events[-1]["event"] == "error", err
    seen.extend(events)
    kinds = {e["event"] for e in seen}
    assert {"start", "skipped", "exporting", "published", "hook", "done", "waiting", "lost", "refused",
            "released", "removed", "idle", "error"} <= kinds, kinds
    assert named(seen, "released") == ["step-4"] and named(seen, "removed") == ["step-2"]


@pytest.mark.parametrize("bad", [
    {"event": "hook", "status": "done"},  # not a status a hook ends with
    {"event": "published", "verified": "yes"},
    {"event": "nonsense"},
    {"event": "error"},  # no error object
    {"step": "7"},
])
def test_the_schema_refuses_what_a_follower_never_writes(bad: dict) -> None:
    import jsonschema

    good = {"schema_version": 1, "command": "export", "ok": True, "tool_version": "0", "event": "hook",
            "name": "step-1", "step": 1, "message": "--on-publish ran for step-1", "status": "ok",
            "exit_code": 0, "error": None, "seconds": 0.1}
    event_validator().validate(good)
    with pytest.raises(jsonschema.ValidationError):
        event_validator().validate(json.loads(json.dumps({**good, **bad})))


def test_stopping_the_follower_mid_hook_ends_its_group_and_the_next_one_runs_it_again(tmp_path: Path) -> None:
    import signal

    from tests.follow_helpers import parse_events

    run, dst = tmp_path / "run", tmp_path / "hf"
    Loop(run).save(1)
    pids = tmp_path / "pids"
    hook = f"sh -c 'sleep 1000 & echo $! >> {pids}; wait' hook"
    proc = start_follow(run, dst, "--from", "all", "--on-publish", hook, once=False)  # the default timeout: 1h
    end = time.monotonic() + 300
    while not (pids.exists() and pids.read_text().endswith("\n")) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.01)  # until the hook's child runs
    os.kill(proc.pid, signal.SIGTERM)
    out, err = communicate(proc, 300)
    events = parse_events(out)
    assert proc.returncode == 0 and events[-1]["event"] == "stopped", err
    assert named(events, "hook") == [] and records(dst)["step-1"]["on_publish"]["status"] == "pending"
    assert _gone(int(pids.read_text().split()[0]))
    # the next follower runs the command recorded at the publish (the hung one again): its timeout ends it
    rc, events, err = run_follow(run, dst, "--on-publish", "true", "--on-publish-timeout", "0.2s")
    assert rc == 0, err
    assert [(e["name"], e["status"]) for e in events if e["event"] == "hook"] == [("step-1", "timeout")]
    assert records(dst)["step-1"]["on_publish"]["status"] == "timeout"
    assert all(_gone(int(p)) for p in pids.read_text().split())
