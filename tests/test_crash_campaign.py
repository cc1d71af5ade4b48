"""The fast crash campaign (issue #8): SIGKILL at every named phase of export --overwrite and resave,
random kills during data writes, a reader polling during publishes, and checks that the harness
can fail. Fault injection and the fsync order (I7) are in test_crash_faults.py.

Every trial runs the real CLI in a real process (forked from a warm interpreter, see
``tests.support.zygote.ZygoteRunner``; two trials use a fresh ``python -m ckptctl`` to show it is
the same), with fsync on, and checks I1, I2, I4 and I8 with ``crash_harness.run_trial``. The long
mode is ``python -m bench.crash_campaign``; its measured table is in docs/RELIABILITY.md.

Not repeated here (already in test_export_crash.py / test_resave.py / test_gc*.py): EIO from
fsync-shard, the exchange EINVAL fallback, ENOSPC on a small tmpfs and RLIMIT_FSIZE for export, a
read-only filesystem and a second writer for export, Ctrl-C during export, a symlinked destination.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests import crash_harness as H
from tests.crash_harness.fixtures import prepared, zygote  # noqa: F401 (fixtures)
from tests.support import MANIFEST, write_config, write_sharded, write_single

pytestmark = pytest.mark.slow

FAST = ["export-sharded-to-single", "export-single-to-sharded", "export-new-destination", "export-two-rename",
        "resave-dtype", "resave-repair", "resave-two-rename"]


def _expected(point: str) -> str:
    if point in H.PUBLISHED_POINTS:
        return "new"
    return "window" if point == "two-rename-between" else "old"


def _show(o: H.Outcome) -> str:
    return json.dumps(o.to_dict(), indent=1, default=str)[:3000]


# ---------------------------------------------------------------------------------------------
# SIGKILL at every named phase boundary (I1, I2, I4 via gc-tmp, I8)

NAMED = [pytest.param(s, p, id=f"{s}@{p}") for s in FAST for p in H.SCENARIOS[s].points]


@pytest.mark.parametrize("scenario,point", NAMED)
def test_kill_at_every_named_point(prepared, zygote, tmp_path, scenario, point):
    prep = prepared(scenario)
    o = H.run_trial(prep, H.Fault("point", point), tmp_path / "t", zygote, recovery="gc")
    assert o.killed and not o.violations, _show(o)
    assert o.after_kill == _expected(point) or (prep.old_absent and o.after_kill == "old"), _show(o)
    assert o.after_recovery in ("old", "new") and o.leaked_after_gc == 0 and o.rerun_identical
    if point not in ("stage-create",):
        assert o.staging_left == 1 and o.gc_removed == 1  # the dead writer's one directory, and only it


# the next run cleans up by itself (startup recovery, K23), no gc-tmp first
RERUN = [pytest.param(s, p, id=f"{s}@{p}") for s, p in [
    ("export-sharded-to-single", "write-data"), ("export-sharded-to-single", "sealed"),
    ("export-sharded-to-single", "exchange"), ("export-sharded-to-single", "after-publish"),
    ("export-new-destination", "rename-noreplace"), ("export-new-destination", "published"),
    ("export-two-rename", "published"), ("resave-dtype", "write-chunk"), ("resave-repair", "index"),
    ("resave-repair", "published"), ("resave-two-rename", "sealed")]]


@pytest.mark.parametrize("scenario,point", RERUN)
def test_rerun_after_a_kill_recovers_by_itself(prepared, zygote, tmp_path, scenario, point):
    o = H.run_trial(prepared(scenario), H.Fault("point", point), tmp_path / "t", zygote, recovery="rerun")
    assert o.killed and not o.violations, _show(o)
    assert o.after_recovery == "new" and o.rerun_identical and o.gc_removed == 0


def test_export_retry_in_the_two_rename_window_keeps_the_destinations_other_files(prepared, zygote, tmp_path):
    o = H.run_trial(prepared("export-two-rename"), H.Fault("point", "two-rename-between"), tmp_path / "t", zygote,
                    recovery="rerun")
    assert o.after_kill == "window"
    assert not o.violations, _show(o)


def test_resave_retry_in_the_two_rename_window_recovers(prepared, zygote, tmp_path):
    o = H.run_trial(prepared("resave-two-rename"), H.Fault("point", "two-rename-between"), tmp_path / "t", zygote,
                    recovery="rerun")
    assert o.after_kill == "window"
    assert not o.violations, _show(o)


@pytest.mark.parametrize("scenario,point", [("export-sharded-to-single", "write-data"),
                                            ("resave-dtype", "published")])
def test_a_fresh_interpreter_behaves_like_the_forked_one(prepared, tmp_path, scenario, point):
    o = H.run_trial(prepared(scenario), H.Fault("point", point), tmp_path / "t", H.ExecRunner())
    assert o.killed and not o.violations and o.after_kill == _expected(point), _show(o)


def test_plain_retry_of_a_new_destination_export_after_its_publish_is_refused(prepared, zygote, tmp_path):
    """I8 for an export without --overwrite: once the first attempt got past its publish, the
    same command again is refused (exit 2, the destination exists) and changes nothing; the
    destination is already byte-identical to a clean run."""
    prep = prepared("export-new-destination")
    p = prep.instantiate(tmp_path / "t")
    argv = prep.scn.argv(p.src, p.dst)
    assert zygote.run(argv, env={"CKPTCTL_KILL_AT": "published"}).rc == -signal.SIGKILL
    r = zygote.run(argv)
    assert r.rc == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
    assert H.snapshot(p.dst) == prep.new_snapshot


# ---------------------------------------------------------------------------------------------
# SIGKILL at random moments while data is written


@pytest.mark.parametrize("scenario", ["big-export-bf16", "big-resave-bf16", "big-resave-reshard"])
def test_kill_at_random_moments(prepared, zygote, tmp_path, scenario):
    prep = prepared(scenario)
    rng = random.Random(f"fast-{scenario}")
    outcomes: list[H.Outcome] = []
    # at least 3 trials, and on until one was really killed: a delay drawn near the end of a
    # clean run's span lets the run complete, more often when a run is quicker than the clean
    # runs measured while the case was prepared (a host that was busier then). After three, each
    # trial aims at half the shortest delay that let a run complete, so the kill does not hang on
    # how fast this machine is now (at most 8 trials: the last at a 32nd of it)
    while len(outcomes) < 3 or (not any(o.killed for o in outcomes) and len(outcomes) < 8):
        i = len(outcomes)
        fault = H.random_fault(rng, prep)
        if i >= 3:
            shortest = min(o.delay or 0.0 for o in outcomes)
            fault = H.Fault("random", delay=round(shortest / 2 ** (i - 2), 4))
        outcomes.append(H.run_trial(prep, fault, tmp_path / f"t{i}", zygote, poll=(i == 0)))
    for o in outcomes:
        assert not o.violations, _show(o)
        assert o.after_kill in ("old", "new") and o.after_recovery in ("old", "new") and o.rerun_identical
    assert any(o.killed for o in outcomes), [_show(o) for o in outcomes]


# ---------------------------------------------------------------------------------------------
# A reader polling the destination during publishes (K19)


def _alternating_publishes(tmp_path: Path, zygote, n: int, env: dict | None = None):
    a_src, b_src = tmp_path / "a", tmp_path / "b"
    write_sharded(a_src, H.model_state(1), max_shard_size=20_000)  # 3 shards + index
    write_single(b_src, H.model_state(2))  # one file
    for d in (a_src, b_src):
        write_config(d)
    ws = tmp_path / "ws"
    ws.mkdir()
    dst = ws / "ckpt"
    assert zygote.run(["export", a_src, dst, "--max-shard-size", "20KB"]).rc == 0
    (dst / "README.md").write_text("card\n")
    versions = {"old": H.dir_signature(dst)}
    assert zygote.run(["export", b_src, dst, "--overwrite"]).rc == 0
    versions["new"] = H.dir_signature(dst)
    assert versions["old"] != versions["new"] and not any(v.startswith("error") for v in versions["old"] + versions["new"])
    poller = H.Poller(dst, versions, absent_ok=bool(env))
    with poller:
        time.sleep(0.05)
        for i in range(n):
            src, extra = (a_src, ["--max-shard-size", "20KB"]) if i % 2 == 0 else (b_src, [])
            r = zygote.run(["export", src, dst, "--overwrite", *extra], env=env)
            assert r.rc == 0, r.stderr
            time.sleep(0.01)
    assert H.our_staging(ws) == []
    return poller.stats


def test_a_reader_never_sees_a_partial_destination_during_publishes(tmp_path, zygote):
    stats = _alternating_publishes(tmp_path, zygote, 16)
    assert not stats.violations, stats.violations[:5]
    # it really read, and saw both versions
    assert stats.observations >= 50 and stats.old > 0 and stats.new > 0, stats
    assert stats.absent == 0


# ---------------------------------------------------------------------------------------------
# The harness can fail: each check rejects a broken state


def test_the_harness_checks_reject_broken_states(prepared, zygote, tmp_path):
    prep = prepared("export-single-to-sharded")
    p = prep.instantiate(tmp_path / "t")
    assert H.classify(p.dst, prep) == "old" and H.check_marker(p.dst) == []
    # a mix: one new shard beside the old single file
    ref = prep.instantiate(tmp_path / "r")
    assert zygote.run(prep.scn.argv(ref.src, ref.dst)).rc == 0
    shutil.copy(ref.dst / "model-00001-of-00003.safetensors", p.dst)
    assert H.classify(p.dst, prep) == "mixed"
    assert any("glob loader" in v for v in H.check_version(p.dst, prep.old_tensors))
    assert any("manifest does not list" in v for v in H.check_marker(p.dst))
    # a manifest that lies about a size
    doc = json.loads((ref.dst / MANIFEST).read_text())
    doc["files"]["model.safetensors.index.json"]["size"] += 1
    (ref.dst / MANIFEST).write_text(json.dumps(doc))
    assert any("manifest size" in v for v in H.check_marker(ref.dst))
    # a leftover nobody can attribute
    stray = p.ws / "_tmp_ckpt.18ecc906440da92e-4404158d"
    (stray / "data").mkdir(parents=True)
    assert H.attributable(stray) is not None


def test_the_poller_catches_a_delete_then_write_publisher(tmp_path):
    """huggingface_hub's save_torch_state_dict removes the old files before writing the new ones;
    the poller must see that window."""
    from huggingface_hub import save_torch_state_dict

    ws = tmp_path / "ws"
    dst = ws / "ckpt"
    write_sharded(dst, H.model_state(1), max_shard_size=20_000)
    versions = {"old": H.dir_signature(dst)}
    other = tmp_path / "b"
    write_single(other, H.model_state(2))
    versions["new"] = H.dir_signature(other)
    poller = H.Poller(dst, versions, path_reads=False)
    with poller:
        for i in range(30):
            save_torch_state_dict(H.model_state(1 if i % 2 else 2), dst, max_shard_size=20_000 if i % 2 else 10 ** 9)
            if poller.stats.violations:
                break
    assert poller.stats.violations
