"""``export --follow`` over a real HF Trainer run (a tiny Llama built from a config, no download)
with ``save_total_limit``: the follower, a real process, runs from the Trainer's ``on_save``
callback (after the Trainer wrote the checkpoint and rotated the old ones), so each save is seen
while training goes on; each published export equals a plain export of the save; retention
keeps the follower's own exports by integer step; a checkpoint without ``trainer_state.json`` (the
Trainer's last file) waits."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.follow_helpers import assert_same_as_plain, leftovers, named, records, run_follow
from tests.support.builders import tiny_llama


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 128, (16,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def train(out: Path, on_save, *, steps: int = 8, every: int = 2, limit: int = 2) -> None:
    import transformers

    class Follow(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            on_save(state.global_step)

    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, save_steps=every, save_total_limit=limit, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_only_model=True, disable_tqdm=True,
        eval_strategy="steps", eval_steps=every, per_device_eval_batch_size=8, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                                   callbacks=[Follow()])
    trainer.train()


def test_trainer_with_save_total_limit_each_save_published_and_retained(tmp_path: Path) -> None:
    out, dst = tmp_path / "run", tmp_path / "hf"
    seen: list[tuple[int, list[str], list[str]]] = []

    def on_save(step: int) -> None:
        rc, events, err = run_follow(out, dst, "--from", "all", "--keep-last", "2", "--keep-best", "eval_loss")
        assert rc == 0, err
        seen.append((step, named(events, "published"), named(events, "removed")))
        assert_same_as_plain(dst / f"checkpoint-{step}", out / f"checkpoint-{step}", tmp_path)

    train(out, on_save)
    assert [s for s, _, _ in seen] == [2, 4, 6, 8]
    assert [p for _, p, _ in seen] == [[f"checkpoint-{s}"] for s in (2, 4, 6, 8)]
    # the Trainer kept 2 checkpoints; the follower published all 4 and its retention decides alone
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    recs = records(dst)
    assert {n: r["status"] for n, r in recs.items()} == {
        n: ("published" if n in kept else "removed") for n in recs
        for kept in [_kept(recs)]}
    published = sorted((r["step"] for r in recs.values() if r["status"] == "published"))
    assert 8 in published and 6 in published  # keep-last 2 (and the newest)
    best = min((r["metrics"]["eval_loss"], r["step"]) for r in recs.values())
    assert best[1] in published  # keep-best eval_loss
    assert all(r["metrics"].get("eval_loss") is not None for r in recs.values())
    for r in recs.values():
        assert (dst / r["name"]).exists() == (r["status"] == "published")
    assert leftovers(dst) == []


def _kept(recs: dict) -> set[str]:
    steps = sorted(r["step"] for r in recs.values())
    best = min((r["metrics"]["eval_loss"], r["step"]) for r in recs.values())[1]
    return {f"checkpoint-{s}" for s in steps[-2:]} | {f"checkpoint-{best}"}


def test_trainer_checkpoint_waits_for_trainer_state_written_last(tmp_path: Path) -> None:
    out, dst = tmp_path / "run", tmp_path / "hf"
    train(out, lambda step: None, steps=2, every=2, limit=2)
    ckpt = out / "checkpoint-2"
    state = ckpt / "trainer_state.json"
    held = tmp_path / "trainer_state.json"
    shutil.move(state, held)  # the moment before the Trainer's last file
    rc, events, err = run_follow(out, dst, "--from", "all")
    assert rc == 0 and named(events, "published") == [], err
    assert "trainer_state.json" in next(e for e in events if e["event"] == "waiting")["reason"]
    doc = json.loads(held.read_text())
    state.write_text(json.dumps({**doc, "global_step": 1}))  # another step's state: not this one's
    rc, events, err = run_follow(out, dst)
    assert named(events, "published") == [] and "global_step 1" in events[-2]["reason"], err
    shutil.move(held, state)
    rc, events, err = run_follow(out, dst)
    assert rc == 0 and named(events, "published") == ["checkpoint-2"], err
    assert_same_as_plain(dst / "checkpoint-2", ckpt, tmp_path)


def test_quiet_period_measured_on_the_saves_own_times(tmp_path: Path) -> None:
    """--quiet-period 60: a checkpoint modified just now waits; the same files dated 2 minutes
    back are complete (no sleep: the times are set)."""
    out, dst = tmp_path / "run", tmp_path / "hf"
    train(out, lambda step: None, steps=2, every=2, limit=2)
    rc, events, err = run_follow(out, dst, "--from", "all", "--quiet-period", "60")
    assert named(events, "published") == [] and "quiet" in events[1]["reason"], err
    back = (os.stat(out).st_mtime_ns - 120 * 10**9)
    for root, dirs, files in os.walk(out / "checkpoint-2"):
        for n in dirs + files + ["."]:
            os.utime(os.path.join(root, n), ns=(back, back))
    rc, events, err = run_follow(out, dst, "--quiet-period", "60")
    assert rc == 0 and named(events, "published") == ["checkpoint-2"], err


@pytest.mark.parametrize("fixture", ["s2_bf16", "s3_fp32"])
def test_trainer_checkpoint_with_zero_inside_replayed_in_deepspeed_order(tmp_path: Path, fixture: str,
                                                                          zero_fixtures: dict) -> None:
    """A Trainer checkpoint holding a DeepSpeed save (real fixture files, copied in DeepSpeed's
    and the Trainer's order): rank files, ``latest``, then the Trainer's files, trainer_state.json
    last. Exported as the ZeRO root it is; a rank file still being written waits."""
    real = zero_fixtures[fixture] / "checkpoint-3"
    out, dst = tmp_path / "run", tmp_path / "hf"
    ckpt = out / "checkpoint-3"
    tag = ckpt / "global_step3"
    tag.mkdir(parents=True)
    ranks = sorted((real / "global_step3").iterdir())
    big = max(ranks, key=lambda p: p.stat().st_size)
    for f in ranks:  # every rank writes; one is half-way through its file
        data = f.read_bytes()
        (tag / f.name).write_bytes(data[: len(data) // 2] if f == big else data)
    shutil.copy(real / "latest", ckpt / "latest")  # rank 0 writes latest while another rank still writes
    for n in sorted(os.listdir(real)):
        if n not in ("global_step3", "latest", "trainer_state.json"):
            shutil.copy(real / n, ckpt / n)
    shutil.copy(real / "trainer_state.json", ckpt / "trainer_state.json")
    rc, events, err = run_follow(out, dst, "--from", "all")
    assert rc == 0 and named(events, "published") == [], err
    assert "zip" in next(e for e in events if e["event"] == "waiting")["reason"]
    shutil.copy(big, tag / big.name)  # the rank finishes
    rc, events, err = run_follow(out, dst)
    assert rc == 0 and named(events, "published") == ["checkpoint-3"], err
    assert records(dst)["checkpoint-3"]["identity"]["tag"] == "global_step3"
    assert_same_as_plain(dst / "checkpoint-3", ckpt, tmp_path)


@pytest.fixture(scope="session")
def zero_fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("deepspeed")
    from tests.test_zero_build import build

    kept = os.environ.get("CKPTCTL_ZERO_FIXTURES")
    return build(Path(kept) if kept else tmp_path_factory.getbasetemp() / "zero-fixtures")
