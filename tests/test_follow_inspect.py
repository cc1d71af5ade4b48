"""``ckptctl inspect DST_ROOT`` of a follower's DST_ROOT: the holder and its source, one row per
save (published, lost, removed, with verify and --on-publish outcomes), as text and as a JSON
document that validates against docs/schemas/inspect.schema.json; records a neighbour garbled or
planted give notes, never a traceback; neither a plain inspect nor this one imports torch or
loads the follower when it need not."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.follow_helpers import STATE, named, records, run_follow
from tests.support import REPO, run_ckptctl
from tests.test_follow_dcp import Loop
from tests.test_verify_startup import modules

jsonschema = pytest.importorskip("jsonschema")


def _inspect_json(dst: Path) -> dict:
    p = run_ckptctl("inspect", dst, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    schema = json.loads((REPO / "docs" / "schemas" / "inspect.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    assert doc["format"] == "follow-root" and "Traceback" not in p.stderr
    return doc


@pytest.fixture(scope="module")
def followed(tmp_path_factory) -> tuple[Path, Path]:
    """Three saves published with --keep-last 1 and a failing hook (two removed), then a save that
    waited (no .metadata yet) deleted before it completed (lost)."""
    tmp = tmp_path_factory.mktemp("inspect")
    run, dst = tmp / "run", tmp / "hf"
    loop = Loop(run)
    for step in (1, 2, 3):
        loop.save(step)
    hook = f"{sys.executable} -c 'raise SystemExit(5)'"
    rc, events, err = run_follow(run, dst, "--from", "all", "--keep-last", "1", "--on-publish", hook)
    assert rc == 0 and named(events, "removed") == ["step-1", "step-2"], err
    (loop.save(4) / ".metadata").unlink()
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "waiting") == ["step-4"], err
    shutil.rmtree(run / "step-4")
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "lost") == ["step-4"], err
    return run, dst


def test_inspect_shows_what_the_follower_published_lost_and_removed(followed: tuple[Path, Path]) -> None:
    run, dst = followed
    doc = _inspect_json(dst)["follow"]
    assert doc["source"] == str(run) and doc["from"] == "all" and doc["notes"] == []
    assert doc["holder"]["live"] is False and "--follow" in doc["holder"]["command"]
    rows = {r["name"]: r for r in doc["saves"]}
    assert [r["name"] for r in doc["saves"]] == ["step-1", "step-2", "step-3", "step-4"]
    assert {n: r["status"] for n, r in rows.items()} == {"step-1": "removed", "step-2": "removed",
                                                         "step-3": "published", "step-4": "lost"}
    assert rows["step-3"]["on_publish"] == "failed" and rows["step-3"]["on_publish_exit_code"] == 5
    assert "deleted before it was exported" in rows["step-4"]["reason"]
    assert doc["counts"] == {"removed": 2, "published": 1, "lost": 1}
    p = run_ckptctl("inspect", dst)
    assert p.returncode == 0, p.stderr
    for text in ("step-3", "published", "removed", "lost", "exit 5", str(run), "not running"):
        assert text in p.stdout, text


def test_a_running_follower_is_live(followed: tuple[Path, Path], tmp_path: Path) -> None:
    """The holder's liveness is judged from its record (pid, start time), never by taking the lock."""
    run, dst = followed
    copy = tmp_path / "hf"
    shutil.copytree(dst, copy, symlinks=True)
    holder = json.loads((copy / STATE / "holder.json").read_text())
    from ckptctl.staging.liveness import process_start_time

    holder.update(pid=os.getpid(), start_time=process_start_time(os.getpid()))
    (copy / STATE / "holder.json").write_text(json.dumps(holder))
    assert _inspect_json(copy)["follow"]["holder"]["live"] is True


def test_flags_for_one_checkpoint_are_refused_on_a_dst_root(followed: tuple[Path, Path]) -> None:
    p = run_ckptctl("inspect", followed[1], "--tensors")
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "hint: " in p.stderr, p.stderr


def test_garbled_and_planted_records_give_notes_not_a_traceback(followed: tuple[Path, Path], tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    shutil.copytree(followed[1], dst, symlinks=True)
    saves = dst / STATE / "saves"
    good = json.loads((saves / "step-3.json").read_text())
    os.mkfifo(saves / "fifo.json")  # never waited on
    (saves / "link.json").symlink_to(saves / "step-3.json")  # never followed
    (saves / "big.json").write_bytes(b" " * (2 << 20))  # over the record limit
    (saves / "garbage.json").write_bytes(b"\xff{not json")
    (saves / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (saves / "foreign.json").write_text(json.dumps({"tool": "other", "name": "foreign"}))
    (saves / "renamed.json").write_text(json.dumps({**good, "name": "step-3"}))  # not its own name
    (saves / "badstatus.json").write_text(json.dumps({**good, "name": "badstatus", "status": {"x": 1}}))
    (saves / "types.json").write_text(json.dumps({**good, "name": "types", "step": "7", "verified": "yes",
                                                   "on_publish": [1], "events": "many",
                                                   "status": "lost"}))
    (saves / "escape.json").write_text(json.dumps({**good, "name": "escape", "status": "refused",
                                                    "events": [{"at": 1, "reason": "\x1b[2Jboom\n"}]}))
    doc = _inspect_json(dst)["follow"]
    notes = "\n".join(doc["notes"])
    for name in ("fifo", "link", "big", "garbage", "deep", "foreign", "renamed", "badstatus"):
        assert f"saves/{name}.json" in notes, (name, notes)
    rows = {r["name"]: r for r in doc["saves"]}
    assert set(rows) == {"step-1", "step-2", "step-3", "step-4", "types", "escape"}
    assert rows["types"]["step"] is None and rows["types"]["verified"] is None and rows["types"]["on_publish"] is None
    assert "saves/types.json: 'step' is not an integer" in notes
    assert "\x1b" not in json.dumps(doc) and rows["escape"]["reason"] == "\\x1b[2Jboom\\n"
    p = run_ckptctl("inspect", dst)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "\x1b[2J" not in p.stdout + p.stderr, p.stderr
    assert "note: " in p.stderr


def test_a_state_with_nothing_readable_is_still_shown(tmp_path: Path) -> None:
    (tmp_path / "hf" / STATE / "saves").mkdir(parents=True)
    (tmp_path / "hf" / STATE / "holder.json").write_text("{")
    doc = _inspect_json(tmp_path / "hf")["follow"]
    assert doc["saves"] == [] and doc["holder"] is None and doc["source"] is None
    assert any("holder.json" in n for n in doc["notes"])


def test_inspect_loads_the_follower_only_for_a_dst_root_and_never_torch(followed: tuple[Path, Path]) -> None:
    from ckptctl.cli.inspect_cmd import FOLLOW_STATE
    from ckptctl.follow.state import STATE_DIR

    assert FOLLOW_STATE == STATE_DIR == STATE
    code, loaded = modules(["inspect", followed[1], "-q"])
    assert code == 0 and "ckptctl.follow.view" in loaded and "torch" not in loaded
    assert not {"ckptctl.follow.loop", "ckptctl.follow.handle"} & loaded
    export = next(p for p in followed[1].iterdir() if p.name == "step-3")
    code, loaded = modules(["inspect", export, "-q"])
    assert code == 0 and not {m for m in loaded if m.startswith("ckptctl.follow")}
    assert records(followed[1])["step-3"]["status"] == "published"
