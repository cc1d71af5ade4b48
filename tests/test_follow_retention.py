"""The follower's retention rules on records (pure), its metrics from trainer_state.json, and the
follower's usage errors (exit 2, one error line, before anything is touched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptctl.errors import UsageError
from ckptctl.follow.retention import Retention, metrics_of, to_remove
from tests.support.cli import run_ckptctl


def recs(*steps: int, verified: dict[int, bool] | None = None, loss: dict[int, float] | None = None) -> list[dict]:
    return [{"name": f"checkpoint-{s}", "step": s, "status": "published",
             "verified": (verified or {}).get(s), "metrics": {"eval_loss": (loss or {})[s]} if loss and s in loss else {}}
            for s in steps]


def removed(records: list[dict], rules: Retention, verify: bool = False) -> list[int]:
    return [r["step"] for r in to_remove(records, rules, verify=verify)]


def test_no_rule_keeps_everything() -> None:
    assert removed(recs(1, 2, 3), Retention()) == []


def test_keep_last_by_integer_step_never_by_name() -> None:
    # "checkpoint-9" > "checkpoint-10" as text: by string order the newest would go
    assert removed(recs(10, 9, 100, 99), Retention.of(2, None, None)) == [9, 10]


def test_rules_union_and_the_newest_always_kept() -> None:
    rules = Retention.of(1, 4, "eval_loss")
    loss = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.8, 6: 0.6}
    assert removed(recs(1, 2, 3, 4, 5, 6, loss=loss), rules) == [1, 3, 5]  # 6 newest, 4 every-4, 2 best


def test_keep_best_direction() -> None:
    acc = {1: 0.5, 2: 0.9, 3: 0.7}
    records = [{**r, "metrics": {"eval_accuracy": acc[r["step"]]}} for r in recs(1, 2, 3)]
    assert removed(records, Retention.of(None, None, "eval_accuracy")) == [1]  # higher is better: 2 kept
    assert removed(records, Retention.of(None, None, "accuracy:min")) == [2]  # eval_ prefix optional; min asked
    loss = [{**r, "metrics": {"train_loss": acc[r["step"]]}} for r in recs(1, 2, 3)]
    assert removed(loss, Retention.of(None, None, "train_loss")) == [2]  # a loss: lower is better


def test_with_verify_only_what_is_older_than_the_newest_verified_goes() -> None:
    rules = Retention.of(1, None, None)
    assert removed(recs(1, 2, 3, verified={1: True, 2: True, 3: False}), rules, verify=True) == [1]
    assert removed(recs(1, 2, 3, verified={3: False}), rules, verify=True) == []
    assert removed(recs(1, 2, 3, verified={3: False}), rules, verify=False) == [1, 2]


def test_only_published_records_are_candidates() -> None:
    records = recs(1, 2, 3) + [{"name": "checkpoint-0", "step": 0, "status": "refused"},
                               {"name": "checkpoint-4", "step": 4, "status": "lost"}]
    assert removed(records, Retention.of(1, None, None)) == [1, 2]


def test_metrics_of_trainer_state() -> None:
    state = {"global_step": 20, "best_metric": 0.3, "log_history": [
        {"step": 10, "loss": 2.0}, {"step": 10, "eval_loss": 0.5}, {"step": 20, "eval_loss": 0.3},
        {"step": 30, "eval_loss": 0.1}, {"step": "x", "odd": True}, "junk"]}
    assert metrics_of(state, 20) == {"loss": 2.0, "eval_loss": 0.3, "best_metric": 0.3}
    assert metrics_of([1, 2], 5) == {} and metrics_of({"log_history": "x"}, 5) == {}


@pytest.mark.parametrize("bad", [(0, None, None), (None, -1, None), (None, None, "eval_loss:best"),
                                 (None, None, ":max")])
def test_bad_rules_are_usage_errors(bad: tuple) -> None:
    with pytest.raises(UsageError):
        Retention.of(*bad)


@pytest.mark.parametrize("args, says", [
    (["--once", "--exit-when-idle", "1m"], "both say when to stop"),
    (["--from", "oldest"], "--from"),
    (["--keep-last", "0"], "--keep-last"),
    (["--quiet-period", "soon"], "--quiet-period"),
    (["--overwrite"], "--overwrite"),
    (["--dry-run"], "--dry-run"),
    (["--priority", "high"], "--priority"),
])
def test_follow_usage_errors(tmp_path: Path, args: list[str], says: str) -> None:
    (tmp_path / "run").mkdir()
    p = run_ckptctl("export", tmp_path / "run", tmp_path / "hf", "--follow", *args)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: ") and says in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "hf").exists()


def test_dst_root_inside_the_source_and_another_source_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "other").mkdir()
    p = run_ckptctl("export", tmp_path / "run", tmp_path / "run" / "hf", "--follow", "--once")
    assert p.returncode == 2 and "outside SAVE_DIR" in p.stderr, p.stderr
    assert run_ckptctl("export", tmp_path / "run", tmp_path / "hf", "--follow", "--once").returncode == 0
    p = run_ckptctl("export", tmp_path / "other", tmp_path / "hf", "--follow", "--once")
    assert p.returncode == 2 and f"follows {tmp_path / 'run'}" in p.stderr, p.stderr
