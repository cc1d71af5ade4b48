"""Helpers of the follower's tests (``tests/test_follow_*.py``): the follower run as a real process,
its JSON-lines events, its records, and a plain export of the same save to compare with."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

from tests.support import REPO
from tests.support.cli import popen_ckptctl, run_ckptctl
from tests.support.fs import snapshot

STATE = ".ckptctl-follow"


def follow_args(src: Path, dst: Path, *extra: object, once: bool = True) -> list[object]:
    """``export SRC DST --follow`` for tests: JSON lines, no quiet period, no fsync (scratch)."""
    return ["export", src, dst, "--follow", *(["--once"] if once else []), "--quiet-period", "0", "--json",
            "--no-fsync", *extra]


def run_follow(src: Path, dst: Path, *extra: object, env: dict[str, str] | None = None,
               timeout: float = 300) -> tuple[int, list[dict[str, Any]], str]:
    """One ``--once`` run as a real process: (exit code, its events, stderr)."""
    p = run_ckptctl(*follow_args(src, dst, *extra), env=env, timeout=timeout)
    return p.returncode, parse_events(p.stdout), p.stderr


def start_follow(src: Path, dst: Path, *extra: object, env: dict[str, str] | None = None,
                 once: bool = True) -> subprocess.Popen:
    return popen_ckptctl(*follow_args(src, dst, *extra, once=once), env=env)


@functools.lru_cache(maxsize=1)
def event_validator() -> Any:
    """docs/schemas/export-follow.schema.json's validator (checked as a schema first)."""
    import jsonschema

    schema = json.loads((REPO / "docs" / "schemas" / "export-follow.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def parse_events(stdout: str) -> list[dict[str, Any]]:
    """Every line of stdout is one JSON document that validates against the follow events' schema
    (every follow test's events are held to it)."""
    out = []
    for line in stdout.splitlines():
        doc = json.loads(line)
        assert list(doc)[:4] == ["schema_version", "command", "ok", "tool_version"], doc
        assert doc["schema_version"] == 1 and doc["command"] == "export" and "event" in doc, doc
        assert doc["ok"] is (doc["event"] != "error"), doc
        event_validator().validate(doc)
        out.append(doc)
    return out


def named(events: list[dict[str, Any]], kind: str) -> list[str]:
    """The save names of the events of one kind, in order."""
    return [e["name"] for e in events if e["event"] == kind]


def records(dst: Path) -> dict[str, dict[str, Any]]:
    saves = dst / STATE / "saves"
    if not saves.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in saves.glob("*.json")}


def plain_export(save: Path, out: Path, *extra: object) -> Path:
    """``ckptctl export SAVE OUT`` (what every published export must equal)."""
    run_ckptctl("export", save, out, "--no-fsync", *extra, check=True)
    return out


def assert_same_as_plain(published: Path, save: Path, scratch: Path, *extra: object) -> None:
    plain = plain_export(save, scratch / f"plain-{published.name}", *extra)
    a, b = snapshot(published), snapshot(plain)
    assert a == b, f"{published} differs from a plain export of {save}: {sorted(set(a.items()) ^ set(b.items()))[:6]}"
    assert any(k.endswith(".safetensors") for k in a), a


def leftovers(dst: Path) -> list[str]:
    """What gc-tmp finds in DST_ROOT that it could not attribute (``unknown``), and every
    entry of DST_ROOT that is neither an export with a record, the state, nor attributable."""
    p = run_ckptctl("gc-tmp", dst, "--dry-run", "--min-age", "0", "--json", check=False)
    doc = json.loads(p.stdout)
    unknown = [c["path"] for c in doc.get("candidates", []) if c.get("kind") != "ours"]
    recs = records(dst)
    ours = {c["path"] for c in doc.get("candidates", [])}
    strays = [str(e) for e in dst.iterdir() if e.name != STATE and e.name not in recs and str(e) not in ours]
    return unknown + strays
