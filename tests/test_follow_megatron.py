"""``export --follow`` over a Megatron-LM ``--save`` directory: real saved iterations (the
megatron-core fixtures of ``tests/test_megatron_build.py``) replayed in Megatron-LM's exact order
(rank files and ``.metadata``, ``metadata.json``, the tracker rewritten in place, tokenizer
files after the tracker, the previous iteration deleted), the follower a real process run at the
moments that matter. Each published export equals a plain export of the iteration folder."""

from __future__ import annotations

import shutil
from pathlib import Path


from tests.follow_helpers import assert_same_as_plain, leftovers, named, records, run_follow
from tests.test_megatron_build import NEEDS_MEGATRON, iteration, megatron_ckpts  # noqa: F401  (fixture)

TRACKER = "latest_checkpointed_iteration.txt"
pytestmark = NEEDS_MEGATRON


class Replay:
    """Megatron-LM's save of one iteration, step by step, from a real saved iteration folder."""

    def __init__(self, real: Path, save: Path) -> None:
        self.real, self.save = real, save
        save.mkdir(parents=True, exist_ok=True)

    def folder(self, it: int) -> Path:
        return self.save / f"iter_{it:07d}"

    def ranks(self, it: int, *, upto: int | None = None) -> None:
        """Rank 0 creates the folder; ranks write their .distcp (and common.pt); ``upto``: only
        that many rank files so far."""
        d = self.folder(it)
        d.mkdir(exist_ok=True)
        shutil.copy(self.real / "common.pt", d / "common.pt")
        files = sorted(p for p in self.real.iterdir() if p.suffix == ".distcp")
        for p in files[:upto]:
            shutil.copy(p, d / p.name)

    def finish(self, it: int) -> None:
        """The remaining rank files, then the coordinator's .metadata, then metadata.json."""
        d = self.folder(it)
        for p in sorted(self.real.glob("*.distcp")):
            if not (d / p.name).exists():
                shutil.copy(p, d / p.name)
        shutil.copy(self.real / ".metadata", d / ".metadata")
        shutil.copy(self.real / "metadata.json", d / "metadata.json")

    def tracker(self, text: str) -> None:
        """Rewritten in place, as Megatron-LM does (truncate, then write)."""
        with open(self.save / TRACKER, "w") as f:
            f.write(text)

    def tokenizer(self, it: int) -> None:
        (self.folder(it) / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')

    def retire(self, it: int) -> None:
        shutil.rmtree(self.folder(it))


def test_megatron_saves_replayed_in_order(tmp_path: Path, megatron_ckpts: dict) -> None:
    real = iteration(megatron_ckpts["llama_tp2"])
    run, dst = tmp_path / "save", tmp_path / "hf"
    r = Replay(real, run)
    r.ranks(10, upto=1)
    rc, events, err = run_follow(run, dst, "--from", "all")
    assert rc == 0 and named(events, "published") == [], err
    assert "no latest_checkpointed_iteration.txt" in events[1]["reason"]
    r.finish(10)
    rc, events, err = run_follow(run, dst)  # the data is there, the tracker is not yet
    assert named(events, "published") == [], err
    r.tracker("10")
    r.tokenizer(10)  # after the tracker
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "published") == ["iter_0000010"], err
    # the next save: a tracker flipped before its folder is complete (an async save's lag)
    r.ranks(20, upto=2)
    r.tracker("20")
    rc, events, err = run_follow(run, dst)
    assert named(events, "published") == [] and ".metadata" in events[1]["reason"], err
    with open(run / TRACKER, "w"):
        pass  # the in-place rewrite, caught between truncate and write
    rc, events, err = run_follow(run, dst)
    assert named(events, "published") == [], err
    r.finish(20)
    r.tracker("20")
    r.tokenizer(20)
    r.retire(10)  # save_retain_interval: the previous iteration goes right after
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "published") == ["iter_0000020"], err
    rc, events, err = run_follow(run, dst)
    assert named(events, "published") == [] and named(events, "lost") == [], err
    assert {n: r["status"] for n, r in records(dst).items()} == {"iter_0000010": "published",
                                                                   "iter_0000020": "published"}
    assert records(dst)["iter_0000020"]["identity"]["iteration"] == 20
    assert_same_as_plain(dst / "iter_0000020", run / "iter_0000020", tmp_path)
    r.ranks(10)
    r.finish(10)  # the export of 10 compared with a plain export of the same files
    assert_same_as_plain(dst / "iter_0000010", run / "iter_0000010", tmp_path)
    assert leftovers(dst) == []


def test_megatron_iteration_deleted_before_its_turn_is_lost(tmp_path: Path, megatron_ckpts: dict) -> None:
    """Seen waiting by one follower, deleted by the trainer, reported lost by the next one (the
    waiting save is on record, not only in a follower's memory)."""
    real = iteration(megatron_ckpts["llama_tp2"])
    run, dst = tmp_path / "save", tmp_path / "hf"
    r = Replay(real, run)
    r.ranks(5, upto=1)
    r.tracker("0")
    rc, events, err = run_follow(run, dst, "--from", "all")
    assert named(events, "waiting") == ["iter_0000005"], err
    assert records(dst)["iter_0000005"]["status"] == "waiting"
    r.retire(5)
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "lost") == ["iter_0000005"], err
    assert records(dst)["iter_0000005"]["status"] == "lost"
    assert not (dst / "iter_0000005").exists()
    rc, events, err = run_follow(run, dst)
    assert named(events, "lost") == [], err  # said once


def test_megatron_options_reach_each_export(tmp_path: Path, megatron_ckpts: dict) -> None:
    """--config (and --no-mtp) given to the follower are given to every export it makes: a config
    that contradicts the tensors refuses the save as a plain export would, never silently dropped."""
    import json

    real = iteration(megatron_ckpts["llama_tp2"])
    run, dst = tmp_path / "save", tmp_path / "hf"
    r = Replay(real, run)
    r.ranks(10)
    r.finish(10)
    r.tracker("10")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 7,
                               "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 3,
                               "vocab_size": 5}))
    rc, events, err = run_follow(run, dst, "--from", "all", "--config", cfg)
    assert named(events, "published") == [] and records(dst)["iter_0000010"]["status"] == "refused", (events, err)
    rc, events, err = run_follow(run, dst, "--no-mtp")  # no MTP layers here: the same export as without it
    assert rc == 0, err
