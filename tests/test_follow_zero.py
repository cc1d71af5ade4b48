"""``export --follow`` over a DeepSpeed root (``latest`` and ``global_stepN/`` folders, no Trainer):
real ZeRO fixture files (``tests/test_zero_build.py``) replayed in DeepSpeed's order (every rank
writes its files in place, then global rank 0 writes ``latest``, which can name a tag whose other
ranks are still writing). Each published export equals a plain export of the step folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.follow_helpers import assert_same_as_plain, leftovers, named, records, run_follow
from tests.test_follow_trainer import zero_fixtures  # noqa: F401  (fixture)
from tests.test_zero_build import NEEDS_DEEPSPEED

pytestmark = NEEDS_DEEPSPEED


def _ranks(real: Path, tag: Path, *, skip: str | None = None) -> None:
    tag.mkdir(parents=True, exist_ok=True)
    for f in sorted((real / "global_step3").iterdir()):
        if f.name != skip:
            shutil.copy(f, tag / f.name)


@pytest.mark.parametrize("fixture", ["s1_fp32", "s3_bf16"])
def test_deepspeed_root_steps_follow_latest(tmp_path: Path, fixture: str, zero_fixtures: dict) -> None:
    real = zero_fixtures[fixture] / "checkpoint-3"
    run, dst = tmp_path / "run", tmp_path / "hf"
    run.mkdir()
    shutil.copy(real / "config.json", run / "config.json")
    optim = sorted(p.name for p in (real / "global_step3").iterdir() if "optim_states" in p.name)
    _ranks(real, run / "global_step3")
    (run / "latest").write_text("global_step3")
    rc, events, err = run_follow(run, dst, "--from", "all")
    assert rc == 0 and named(events, "published") == ["global_step3"], err
    # the next save: rank 0 done and latest written, the last rank's optimizer states not yet there
    _ranks(real, run / "global_step10", skip=optim[-1])
    rc, events, err = run_follow(run, dst)
    assert named(events, "published") == [] and "latest names global_step3" in events[1]["reason"], err
    (run / "latest").write_text("global_step10")
    rc, events, err = run_follow(run, dst)
    assert named(events, "published") == [] and "optim" in events[1]["reason"], err
    shutil.copy(real / "global_step3" / optim[-1], run / "global_step10" / optim[-1])
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "published") == ["global_step10"], err
    assert records(dst)["global_step10"]["identity"]["tag"] == "global_step10"
    for name in ("global_step3", "global_step10"):
        assert_same_as_plain(dst / name, run / name, tmp_path)
    assert leftovers(dst) == []


def test_real_deepspeed_run_followed_between_its_saves(tmp_path: Path) -> None:
    """A real 2-rank DeepSpeed ZeRO-2 run (CPU, Gloo) saving three times; after each save rank 0
    runs the follower (--once, --keep-last 2) while the job lives (tests/follow_deepspeed_worker.py)."""
    import sys

    from tests.follow_helpers import parse_events
    from tests.support.cli import REPO
    from tests.support.ranks import build_once

    out = tmp_path / "job"
    build_once(out, [sys.executable, str(REPO / "tests" / "follow_deepspeed_worker.py"), str(out)], world=2,
               env=dict(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"),
               timeout=600, what="DeepSpeed follow")
    run, dst = out / "run", out / "hf"
    published = []
    for save in (2, 4, 6):
        code, _, err = (out / f"follow-{save}.err").read_text().partition("\n")
        assert code == "0", err
        events = parse_events((out / f"follow-{save}.jsonl").read_text())
        published += named(events, "published")
    assert published == ["global_step2", "global_step4", "global_step6"]
    recs = records(dst)
    assert {n: r["status"] for n, r in recs.items()} == {"global_step2": "removed", "global_step4": "published",
                                                          "global_step6": "published"}
    for name in ("global_step4", "global_step6"):
        assert_same_as_plain(dst / name, run / name, tmp_path)
    assert leftovers(dst) == []
