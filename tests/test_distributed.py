"""Multi-rank writing with real processes and Gloo on CPU."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from ckptctl.manifest import sha256_file
from tests.support import REPO, load_hub, run_ckptctl, same, staging_dirs, write_single
from tests.support import load_glob as load_dir
from tests.dist_worker import full_state


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, argv: list[str], local_world: int | None = None, timeout: float = 120):
    port = _port()
    procs = []
    for rank in range(world):
        lw = local_world or world
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank % lw), LOCAL_WORLD_SIZE=str(lw),
                   PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        outs.append((p.returncode, out, err))
    return outs


def _results(outs):
    res = []
    for rc, out, err in outs:
        lines = [l for l in out.splitlines() if l.startswith("{")]
        res.append((rc, json.loads(lines[-1]) if lines else None, err))
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_write_one_checkpoint_equal_to_single_process(tmp_path, world):
    dest = tmp_path / "dist"
    outs = _results(_launch(world, ["tests/dist_worker.py", "ok", str(dest), json.dumps({"max_shard_size": "20KB"})]))
    assert all(rc == 0 and doc["ok"] for rc, doc, _ in outs), outs
    assert same(load_dir(dest), full_state()) and same(load_hub(dest), full_state())
    assert json.loads((dest / "config.json").read_text()) == {"model_type": "test"}
    assert run_ckptctl("inspect", str(dest)).returncode == 0
    # the plan does not depend on the rank count: same bytes as one process with the same order
    from ckptctl.api import save_state_dict
    from ckptctl.distributed import _natural_key

    sd = full_state()
    ordered = {k: sd[k] for k in sorted(sd, key=_natural_key)}
    save_state_dict(ordered, tmp_path / "single", max_shard_size="20KB",
                    extras={"config.json": b'{"model_type": "test"}'})
    for name in os.listdir(tmp_path / "single"):
        assert sha256_file(dest / name) == sha256_file(tmp_path / "single" / name), name
    assert sorted(os.listdir(dest)) == sorted(os.listdir(tmp_path / "single"))
    assert staging_dirs(tmp_path) == []


# the single-process writer's step names; a failure in any of them (before publish) publishes nothing
@pytest.mark.parametrize("phase", ["plan", "stage", "write", "finalize"])
def test_error_on_one_rank_reaches_every_rank_and_nothing_is_published(tmp_path, phase):
    dest = tmp_path / "dist"
    write_single(dest, {"old": torch.ones(3)})
    fail = {"rank": 1, "at": f"dist-{phase}", "errno": "EIO"}
    outs = _results(_launch(2, ["tests/dist_worker.py", "fail", str(dest),
                                json.dumps({"fail": fail, "overwrite": True, "max_shard_size": "20KB"})]))
    for rc, doc, err in outs:
        assert rc == 3, err
        assert doc["phase"] == phase and "rank 1" in doc["message"] and "injected" in doc["message"]
    assert outs[0][1]["message"] == outs[1][1]["message"]
    assert same(load_dir(dest), {"old": torch.ones(3)})
    assert staging_dirs(tmp_path) == []


def test_rank_killed_mid_write_fails_the_others_in_time(tmp_path):
    dest = tmp_path / "dist"
    write_single(dest, {"old": torch.ones(3)})
    fail = {"rank": 1, "at": "write-data", "how": "kill"}
    started = time.monotonic()
    outs = _launch(2, ["tests/dist_worker.py", "kill", str(dest),
                       json.dumps({"fail": fail, "overwrite": True, "timeout": 20})], timeout=90)
    assert time.monotonic() - started < 60
    assert outs[1][0] == -signal.SIGKILL
    rc0, out0, err0 = outs[0]
    assert rc0 == 3, err0
    doc = json.loads([l for l in out0.splitlines() if l.startswith("{")][-1])
    assert doc["phase"] == "write" and "collective failed" in doc["message"]
    assert same(load_dir(dest), {"old": torch.ones(3)})
    assert staging_dirs(tmp_path) == []  # rank 0 staged and cleaned up


def test_node_local_storage_two_nodes(tmp_path):
    outs = _results(_launch(4, ["tests/dist_worker.py", "nodes", str(tmp_path),
                                json.dumps({"storage": "node-local", "max_shard_size": "20KB"})], local_world=2))
    assert all(rc == 0 for rc, _, _ in outs), outs
    a, b = tmp_path / "node0" / "ckpt", tmp_path / "node1" / "ckpt"
    assert same(load_dir(a), full_state()) and same(load_dir(b), full_state())
    for name in os.listdir(a):
        assert sha256_file(a / name) == sha256_file(b / name)
    assert staging_dirs(tmp_path / "node0") == [] and staging_dirs(tmp_path / "node1") == []


@pytest.mark.parametrize("world", [2])
def test_torchrun_export_is_byte_identical_to_single_process(tmp_path, world):
    src = tmp_path / "src"
    write_single(src, full_state())
    (src / "config.json").write_text('{"model_type": "llama"}')
    run_ckptctl("export", str(src), str(tmp_path / "one"), "--max-shard-size", "20KB", check=True)
    outs = _launch(world, ["-m", "ckptctl", "export", str(src), str(tmp_path / "many"), "--max-shard-size", "20KB",
                           "--json"])
    assert all(rc == 0 for rc, _, _ in outs), outs
    doc = json.loads(outs[0][1])
    assert doc["ok"] and outs[1][1] == ""
    # every rank's writes are counted (same dtype: all copied by the kernel, none streamed)
    tensor_bytes = sum(t.numel() * t.element_size() for t in full_state().values())
    assert doc["bytes_copied_by_kernel"] == tensor_bytes and doc["bytes_streamed"] == 0, doc
    assert sorted(os.listdir(tmp_path / "one")) == sorted(os.listdir(tmp_path / "many"))
    for name in os.listdir(tmp_path / "one"):
        assert sha256_file(tmp_path / "one" / name) == sha256_file(tmp_path / "many" / name), name
