"""Every command's --json document validates against its schema in docs/schemas/ (issue 46), on
success and on failure, through the real entry point; one schema version for the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptctl._version import SCHEMA_VERSION
from ckptctl.cli import COMMANDS
from tests.support import REPO, run_ckptctl, state
from tests.support.builders import write_config, write_sharded

jsonschema = pytest.importorskip("jsonschema")
SCHEMAS = REPO / "docs" / "schemas"


def _validate(command: str, stdout: str) -> dict:
    doc = json.loads(stdout)  # exactly one document
    schema = json.loads((SCHEMAS / f"{command}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["command"] == command
    return doc


def test_a_schema_per_command_and_one_version() -> None:
    follow_events = ["export-follow.schema.json"]  # export --follow's event documents (tests/test_follow_events.py)
    assert sorted(p.name for p in SCHEMAS.glob("*.schema.json")) == sorted(
        [f"{c}.schema.json" for c in COMMANDS] + follow_events)
    for path in SCHEMAS.glob("*.schema.json"):
        assert json.loads(path.read_text())["properties"]["schema_version"] == {"const": SCHEMA_VERSION}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    write_sharded(d, state(2, n=4), per_shard=2)
    write_config(d, architectures=["LlamaForCausalLM"])
    return d


def test_success_documents_validate(ckpt: Path, tmp_path: Path) -> None:
    runs = {
        "export": ["export", ckpt, tmp_path / "out", "--no-fsync", "--max-shard-size", "keep"],
        "resave": ["resave", tmp_path / "out", "--dtype", "bf16", "--no-fsync"],
        "inspect": ["inspect", ckpt],
        "verify": ["verify", "--static", ckpt],
        "gc-tmp": ["gc-tmp", tmp_path],
        "env": ["env"],
    }
    assert sorted(runs) == sorted(COMMANDS)
    for command, args in runs.items():
        r = run_ckptctl(*args, "--json")
        assert r.returncode == 0, (command, r.stderr)
        assert _validate(command, r.stdout)["ok"] is True
    doc = _validate("export", run_ckptctl("export", ckpt, tmp_path / "dry", "--dry-run", "--json").stdout)
    assert doc["dry_run"] is True


def test_failure_documents_validate(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 7)
    leak = tmp_path / "gc" / "_tmp_ckpt.18ecc906440da92e-4404158d"
    leak.mkdir(parents=True)
    (leak / "owner.json").write_text(json.dumps({"tool": "ckptctl", "pid": 1 << 22, "host": "node-9.invalid"}))
    runs = [
        ("export", ["export", ckpt, tmp_path / "out"], 2),  # a damaged shard
        ("export", ["export", "--dtype", "bf17", ckpt, tmp_path / "out"], 2),  # Typer's usage error
        ("resave", ["resave", tmp_path / "absent"], 2),
        ("inspect", ["inspect", ckpt / "model-00002-of-00002.safetensors"], 2),
        ("verify", ["verify", "--static", ckpt], 1),  # findings: ok false, no error object
        ("verify", ["verify"], 2),
        ("gc-tmp", ["gc-tmp", "--check", "--older-than", "0s", "--min-age", "0", tmp_path / "gc"], 1),
        ("gc-tmp", ["gc-tmp", "--older-than", "soon", tmp_path], 2),
        ("env", ["env", "--bogus"], 2),
    ]
    for command, args, code in runs:
        r = run_ckptctl(*args, "--json")
        assert r.returncode == code, (args, r.stderr)
        doc = _validate(command, r.stdout)
        assert doc["ok"] is False, args
        if "error" in doc:
            assert doc["error"]["exit_code"] == code and doc["error"]["message"] in r.stderr
