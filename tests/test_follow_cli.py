"""``export``'s follow-only options: given without ``--follow`` they are a usage error (exit 2, the
house ``error:`` + ``hint:``), never ignored; ``--from`` and ``--priority`` are choices from one
list each (follow/choices.py), refused like any choice and completed by the shell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptctl.follow.choices import FROM_CHOICES, PRIORITY_CHOICES
from tests.support import run_ckptctl, write_tiny_checkpoint
from tests.test_cli_conventions import assert_one_line_error
from tests.test_completions import complete


@pytest.mark.parametrize("args, flags", [
    (["--once"], "--once"),
    (["--keep-last", "3"], "--keep-last"),
    (["--keep-every", "10"], "--keep-every"),
    (["--keep-best", "eval_loss"], "--keep-best"),
    (["--on-publish", "true"], "--on-publish"),
    (["--on-publish-timeout", "1m"], "--on-publish-timeout"),
    (["--from", "newest"], "--from"),  # the default's value, given: still refused
    (["--from", "all"], "--from"),
    (["--priority", "low"], "--priority"),
    (["--quiet-period", "30s"], "--quiet-period"),
    (["--poll-interval", "1s"], "--poll-interval"),
    (["--exit-when-idle", "1m"], "--exit-when-idle"),
    (["--verify"], "--verify"),
    (["--once", "--keep-last", "2"], "--once, --keep-last apply"),
])
def test_follow_only_flags_without_follow_are_usage_errors(tmp_path: Path, args: list[str], flags: str) -> None:
    src = write_tiny_checkpoint(tmp_path / "ckpt")
    p = run_ckptctl("export", src, tmp_path / "out", *args)
    assert p.returncode == 2, p.stderr
    assert_one_line_error(p.stderr)
    assert flags in p.stderr and "only with --follow" in p.stderr and "add --follow" in p.stderr
    assert not (tmp_path / "out").exists()


def test_the_refusal_is_a_json_document_too(tmp_path: Path) -> None:
    p = run_ckptctl("export", write_tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "out", "--once", "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 2 and doc["ok"] is False and doc["error"]["code"] == "usage"


def test_a_plain_export_is_untouched(tmp_path: Path) -> None:
    p = run_ckptctl("export", write_tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "out", "--no-fsync")
    assert p.returncode == 0 and (tmp_path / "out").is_dir(), p.stderr


@pytest.mark.parametrize("flag, bad, values", [("--from", "oldest", FROM_CHOICES),
                                               ("--priority", "high", PRIORITY_CHOICES)])
def test_from_and_priority_are_choices(tmp_path: Path, flag: str, bad: str, values: tuple[str, ...]) -> None:
    (tmp_path / "run").mkdir()
    p = run_ckptctl("export", tmp_path / "run", tmp_path / "hf", "--follow", "--once", flag, bad)
    assert p.returncode == 2, p.stderr
    assert_one_line_error(p.stderr)
    assert f"invalid value for {flag}" in p.stderr and all(v in p.stderr for v in values)
    assert complete(f"ckptctl export a b {flag} ", 5) == list(values)
    assert complete(f"ckptctl export a b {flag} {values[-1][:2]}", 5) == [values[-1]]
    assert f"<{'|'.join(values)}>" in run_ckptctl("export", "--help").stdout.replace("\n", " ")
