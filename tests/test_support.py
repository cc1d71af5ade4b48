"""The test support package can fail: ``same`` tells apart what ``torch.equal`` does not, each
loader refuses what its library refuses, the runners report what really happened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.support import (INDEX, LoadError, clean_env, differences, invoke, load_glob, load_hub, load_single_first,
                           load_with_transformers, popen_ckptctl, run_ckptctl, same, snapshot, state, tiny_llama,
                           wait_stopped, write_config, write_pickle, write_sharded, write_single)

# ---------------------------------------------------------------------------------------------
# same(): names, dtype, shape, bytes


def test_same_sees_what_torch_equal_misses():
    a = {"w": torch.zeros(4)}
    assert torch.equal(a["w"], torch.zeros(4, dtype=torch.float16))  # why same() exists
    assert not same(a, {"w": torch.zeros(4, dtype=torch.float16)})
    assert differences(a, {"w": torch.zeros(4, dtype=torch.float16)}) == ["w: dtype torch.float32 != torch.float16"]
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same({"w": torch.tensor([0.0])}, {"w": torch.tensor([-0.0])})
    nan = torch.tensor([float("nan")])
    assert not torch.equal(nan, nan.clone()) and same({"w": nan}, {"w": nan.clone()})


def test_same_compares_names_shapes_and_bytes():
    x = torch.arange(6.0)
    assert same({"w": x.reshape(2, 3)}, {"w": x.reshape(2, 3).clone()})
    assert differences({"w": x.reshape(2, 3)}, {"w": x.reshape(3, 2)}) == ["w: shape (2, 3) != (3, 2)"]
    assert differences({"w": x}, {"w": x + 1}) == ["w: different bytes"]
    assert not same({"w": x}, {"w": x, "v": x}) and not same({"w": x}, {"v": x})
    assert same({"t": x.reshape(2, 3).t()}, {"t": x.reshape(2, 3).t().contiguous()})  # layout does not matter
    assert same({"s": torch.tensor(1.5)}, {"s": torch.tensor(1.5)}) and same({}, {})


# ---------------------------------------------------------------------------------------------
# builders and loaders


def test_state_is_deterministic_and_named():
    a, b = state(3, n=2), state(3, n=2)
    assert same(a, b) and list(a) == ["layer.0.weight", "layer.1.weight"] and not same(a, state(4, n=2))
    assert list(state(1, n=1, name="model.layers.{i}.mlp.weight")) == ["model.layers.0.mlp.weight"]
    assert state(1, n=1, dtype=torch.bfloat16)["layer.0.weight"].dtype == torch.bfloat16


def test_the_three_loaders_agree_on_a_clean_checkpoint(tmp_path):
    sd = state(1)
    write_sharded(tmp_path / "sharded", sd, per_shard=2)
    assert len(list((tmp_path / "sharded").glob("model-*-of-00003.safetensors"))) == 3
    write_single(tmp_path / "single", sd)
    for d in ("sharded", "single"):
        for load in (load_glob, load_hub, load_single_first):
            assert same(load(tmp_path / d), sd), (d, load.__name__)
    with pytest.raises(TypeError):
        write_sharded(tmp_path / "x", sd)


def test_index_first_and_single_first_disagree_where_the_libraries_do(tmp_path):
    d = tmp_path / "both"
    write_sharded(d, state(1), per_shard=2)
    write_single(d, state(2))
    assert same(load_hub(d), state(1)) and same(load_single_first(d), state(2))
    with pytest.raises(LoadError, match="in two files"):
        load_glob(d)


def test_hub_loader_refuses_an_index_that_lies(tmp_path):
    d = tmp_path / "c"
    write_sharded(d, state(1), per_shard=2)
    idx = json.loads((d / INDEX).read_text())
    idx["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (d / INDEX).write_text(json.dumps(idx))
    with pytest.raises(LoadError, match="index and shards disagree"):
        load_hub(d)


def test_hub_loader_refuses_two_unindexed_files_as_huggingface_hub_does(tmp_path):
    write_single(tmp_path, state(1))
    write_single(tmp_path, state(2), name="other.safetensors")
    with pytest.raises(ValueError, match="does not contain a valid checkpoint"):
        load_hub(tmp_path)


def test_a_pickle_and_a_config(tmp_path):
    p = write_pickle(tmp_path, state(1, n=2))
    assert same(torch.load(p, weights_only=True), state(1, n=2))
    cfg = json.loads(write_config(tmp_path, dtype="bfloat16", vocab_size=8).read_text())
    assert cfg == {"model_type": "llama", "torch_dtype": "bfloat16", "vocab_size": 8}


def test_transformers_reloads_a_tiny_model_with_its_own_dtype(tmp_path):
    model = tiny_llama(tie=True)
    assert model.config.tie_word_embeddings and not model.training
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    loaded = load_with_transformers(tmp_path / "m")
    assert same(loaded.state_dict(), model.state_dict())
    assert same(tiny_llama().state_dict(), tiny_llama().state_dict())  # seeded


# ---------------------------------------------------------------------------------------------
# runners


def test_clean_env_drops_every_ckptctl_variable(monkeypatch):
    monkeypatch.setenv("CKPTCTL_KILL_AT", "publish")
    monkeypatch.setenv("CKPTCTL_DEBUG", "1")
    env = clean_env({"CKPTCTL_STOP_AT": "sealed"})
    assert [k for k in env if k.startswith("CKPTCTL_")] == ["CKPTCTL_STOP_AT"] and env["PATH"] == os.environ["PATH"]


def test_in_process_runner_ignores_the_callers_debug_flag(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTCTL_DEBUG", "1")
    res = invoke("inspect", tmp_path / "absent")
    assert res.exit_code == 2 and "Traceback" not in res.stderr and res.stderr.startswith("error: ")
    res = invoke("inspect", tmp_path / "absent", env={"CKPTCTL_DEBUG": "1"})
    assert res.exit_code == 2 and "Traceback" in res.stderr


def test_run_ckptctl_reports_the_exit_code_and_check_fails_the_test(tmp_path):
    p = run_ckptctl("inspect", tmp_path / "absent", env={"CKPTCTL_DEBUG": "1"})
    assert p.returncode == 2 and p.stdout == "" and "InputError" in p.stderr
    with pytest.raises(AssertionError, match=r"failed \(2\)"):
        run_ckptctl("inspect", tmp_path / "absent", check=True)
    with pytest.raises(subprocess.TimeoutExpired):
        run_ckptctl("inspect", tmp_path, timeout=0.01)


def test_wait_stopped_sees_a_stop_and_an_exit(tmp_path):
    write_single(tmp_path / "src", state(1, n=1))
    proc = popen_ckptctl("export", tmp_path / "src", tmp_path / "dst", env={"CKPTCTL_STOP_AT": "stage-created"})
    wait_stopped(proc.pid)
    assert not (tmp_path / "dst").exists() and [p.name.startswith("_tmp_dst.") for p in tmp_path.iterdir()
                                                 if p.name != "src"] == [True]
    proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "wrote" in out and same(load_glob(tmp_path / "dst"), state(1, n=1))
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match="exited instead of stopping"):
        wait_stopped(quick.pid, timeout=60)
    quick.wait()


def test_snapshot_never_follows_links(tmp_path: Path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    snap = snapshot(tmp_path)
    assert snap["link"] == f"link:{tmp_path / 'd'}" and "link/f" not in snap and snap["d"] == "dir"
    (tmp_path / "d" / "f").write_text("y")
    assert snapshot(tmp_path)["d/f"] != snap["d/f"]
