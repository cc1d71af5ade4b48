"""``export --follow`` over a torch DCP training loop (real ``dcp.save`` of a model trained step by
step), the follower a real process: each published export equals a plain export of the save, byte
for byte; steps in integer order; a step saved again is a new save; a step being rewritten waits."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from pathlib import Path

import pytest
import torch

from tests.follow_helpers import (assert_same_as_plain, leftovers, named, parse_events, records, run_follow,
                                  start_follow)


class Loop:
    """A tiny model trained with SGD; ``save(step)`` writes ``run/step-<step>`` with ``dcp.save``."""

    def __init__(self, run: Path) -> None:
        torch.manual_seed(0)
        self.run = run
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train(self) -> None:
        x = torch.randn(4, 16)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def save(self, step: int, name: str | None = None) -> Path:
        import torch.distributed.checkpoint as dcp

        self.train()
        path = self.run / (name or f"step-{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(self.model.state_dict(), checkpoint_id=str(path))
        return path


def test_dcp_loop_each_save_published_once_equal_to_plain_export(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    loop.save(9)
    rc, events, err = run_follow(run, dst, "--from", "all")
    assert rc == 0, err
    assert named(events, "published") == ["step-9"]
    for step in (10, 100):  # integer order: step-100 after step-10 (and after step-9)
        loop.save(step)
    rc, events, err = run_follow(run, dst)
    assert rc == 0, err
    assert named(events, "published") == ["step-10", "step-100"]
    rc, events, err = run_follow(run, dst)  # nothing new: nothing exported twice
    assert rc == 0 and named(events, "published") == [] and events[-1]["event"] == "done", err
    for name in ("step-9", "step-10", "step-100"):
        assert_same_as_plain(dst / name, run / name, tmp_path)
        assert records(dst)[name]["status"] == "published"
    assert leftovers(dst) == []


def test_from_newest_takes_the_newest_by_integer_step(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    for step in (9, 10):  # "step-9" sorts after "step-10" as text
        loop.save(step)
    rc, events, err = run_follow(run, dst)
    assert rc == 0, err
    assert named(events, "skipped") == ["step-9"] and named(events, "published") == ["step-10"]
    loop.save(11)
    rc, events, err = run_follow(run, dst)
    assert named(events, "published") == ["step-11"] and not named(events, "skipped"), err
    assert not (dst / "step-9").exists()


def test_a_step_saved_again_is_a_new_save_and_one_being_rewritten_waits(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    step = loop.save(5)
    rc, events, err = run_follow(run, dst, "--from", "all")
    assert named(events, "published") == ["step-5"], err
    first = records(dst)["step-5"]
    # DCP's overwrite: the data rewritten in place while the old .metadata is still there
    meta = step / ".metadata"
    past = meta.stat().st_mtime_ns - 10_000_000_000
    os.utime(meta, ns=(past, past))
    data = next(step.glob("*.distcp"))
    os.utime(data)
    rc, events, err = run_follow(run, dst)
    assert named(events, "published") == [] and named(events, "waiting") == ["step-5"], err
    assert "newer than .metadata" in events[1]["reason"]
    loop.save(5)  # the save completes: a new save id
    rc, events, err = run_follow(run, dst)
    assert rc == 0 and named(events, "published") == ["step-5"], err
    again = records(dst)["step-5"]
    assert again["identity"]["save_id"] != first["identity"]["save_id"]
    assert_same_as_plain(dst / "step-5", step, tmp_path)
    assert leftovers(dst) == []


def test_running_follower_publishes_each_save_then_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    run.mkdir()
    loop = Loop(run)
    proc = start_follow(run, dst, "--poll-interval", "0.05s", once=False)
    watchdog = threading.Timer(240, proc.kill)  # a hung follower fails the test instead of hanging it
    watchdog.start()
    try:
        lines: list[str] = []
        for step in (1, 2, 3):
            loop.save(step)
            while True:  # wait for the event, not for a time
                line = proc.stdout.readline()
                assert line, f"follower exited: {proc.stderr.read()}"
                lines.append(line)
                if '"published"' in line and f'"step-{step}"' in line:
                    break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
    events = parse_events("".join(lines) + out)
    assert proc.returncode == 0, err
    assert named(events, "published") == ["step-1", "step-2", "step-3"]
    assert events[-1]["event"] == "stopped" and events[-1]["signal"] == "SIGTERM"
    for step in (1, 2, 3):
        assert_same_as_plain(dst / f"step-{step}", run / f"step-{step}", tmp_path)


@pytest.mark.parametrize("low", [True, False])
def test_priority_low_by_default_inherited_by_the_hook(tmp_path: Path, low: bool) -> None:
    run, dst = tmp_path / "run", tmp_path / "hf"
    Loop(run).save(1)
    probe = tmp_path / "probe.txt"
    hook = ("python -c \"import os,sys; from ckptctl.follow.priority import ioprio_get; "
            f"open({str(probe)!r}, 'w').write(repr((os.nice(0), ioprio_get())))\"")
    rc, events, err = run_follow(run, dst, "--on-publish", hook, *([] if low else ["--priority", "normal"]))
    assert rc == 0, err
    nice, (io_class, level) = eval(probe.read_text())
    base = os.nice(0)
    if low:
        assert nice >= min(base + 10, 19) and (io_class, level) == (2, 7)
    else:
        assert nice == base and (io_class, level) != (2, 7)


def test_training_state_with_key_and_export_options_as_a_plain_export(tmp_path: Path) -> None:
    """A DCP training state (model and optimizer): --key model and --dtype bf16 apply to every save,
    as to a plain export."""
    import torch.distributed.checkpoint as dcp

    run, dst = tmp_path / "run", tmp_path / "hf"
    loop = Loop(run)
    for step in (1, 2):
        loop.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": loop.model.state_dict(), "optim": loop.opt.state_dict(), "step": step},
                     checkpoint_id=str(run / f"step_{step}"))
    rc, events, err = run_follow(run, dst, "--from", "all", "--key", "model", "--dtype", "bf16")
    assert rc == 0 and named(events, "published") == ["step_1", "step_2"], err
    for step in (1, 2):
        assert_same_as_plain(dst / f"step_{step}", run / f"step_{step}", tmp_path, "--key", "model", "--dtype", "bf16")


def test_a_record_planted_in_dst_root_never_points_retention_elsewhere(tmp_path: Path) -> None:
    """A neighbour who can write into a shared DST_ROOT plants a record whose dest is another
    directory (status published, the victim's identity): retention keeps the newest only, and the
    victim is untouched; the follower's exports live at DST_ROOT/<name> whatever a record says."""
    import json

    run, dst, victim = tmp_path / "run", tmp_path / "hf", tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    loop = Loop(run)
    loop.save(1)
    rc, _, err = run_follow(run, dst, "--from", "all", "--keep-last", "1")
    assert rc == 0, err
    planted = dict(records(dst)["step-1"], name="step-0", step=0, dest=str(victim))
    (dst / ".ckptctl-follow" / "saves" / "step-0.json").write_text(json.dumps(planted))
    loop.save(2)
    rc, events, err = run_follow(run, dst, "--keep-last", "1")
    assert rc == 0, err
    assert (victim / "precious.txt").read_text() == "mine"
    assert not (dst / "step-1").exists() and (dst / "step-2").is_dir()
    assert records(dst).get("step-0", {}).get("dest") in (None, str(dst / "step-0"))  # never the record's word


def test_a_state_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    run, dst, elsewhere = tmp_path / "run", tmp_path / "hf", tmp_path / "elsewhere"
    Loop(run).save(1)
    dst.mkdir()
    elsewhere.mkdir()
    (dst / ".ckptctl-follow").symlink_to(elsewhere)
    rc, _, err = run_follow(run, dst, "--from", "all")
    assert rc == 3 and "is a link" in err and os.listdir(elsewhere) == [], err
