"""``inspect`` of a Megatron checkpoint (the arguments and the mapping an export applies), and of
a torch DCP training state (issue 30's DCP part: its top-level keys instead of an exit 2)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from tests.support import invoke
from tests.test_megatron_build import NEEDS_MEGATRON, iteration, megatron_ckpts  # noqa: F401 - the fixture


def _inspect(*args: object) -> dict:
    r = invoke("inspect", *args, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@NEEDS_MEGATRON
def test_inspect_shows_the_arguments_and_the_tensors_the_export_writes(megatron_ckpts, tmp_path):
    root = megatron_ckpts["mixtral_ep2"]
    doc = _inspect(root)
    assert doc["format"] == "megatron-torch_dist"
    mega = doc["megatron"]
    assert mega["mapping"] == "mixtral" and mega["iteration"] == "7" and mega["mapping_error"] is None
    assert mega["args"]["num_experts"] == 4 and mega["args"]["padded_vocab_size"] == 128
    assert doc["config"]["architectures"] == ["MixtralForCausalLM"] and doc["config"]["vocab_size"] == 102
    names = {t["name"]: t for t in doc["tensors"]}
    # the padding removed, as exported: the NullTokenizer's vocab_size 101 and its EOD row
    assert names["model.embed_tokens.weight"]["shape"] == [102, 64]
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    r = _inspect(root)  # the same tensors the export writes
    out = tmp_path / "hf"
    assert invoke("export", root, out, "--no-fsync").exit_code == 0
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(t["name"] for t in r["tensors"])
    human = invoke("inspect", iteration(root))
    assert human.exit_code == 0 and "megatron arguments" in human.stdout and "mixtral (Hugging Face names)" in human.stdout


@NEEDS_MEGATRON
def test_inspect_of_an_uncovered_model_lists_megatron_names_and_says_why(megatron_ckpts, tmp_path):
    src = tmp_path / "run"
    shutil.copytree(megatron_ckpts["llama_tp2"], src)
    common = iteration(src) / "common.pt"
    obj = torch.load(common, weights_only=False)
    obj["args"] = argparse.Namespace(**{**vars(obj["args"]), "multi_latent_attention": True})
    torch.save(obj, common)
    doc = _inspect(src)
    assert doc["megatron"]["mapping"] is None and "multi-latent attention (MLA) without experts is not covered" in doc["megatron"]["mapping_error"]
    assert "decoder.layers.self_attention.linear_qkv.weight" in {t["name"] for t in doc["tensors"]}


def _training_state(d: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}, checkpoint_id=str(d),
             no_dist=True)
    return model, opt


def test_inspect_of_a_dcp_training_state_lists_its_top_level_keys(tmp_path):
    """It used to exit 2 asking for --key; it shows each key's tensors, sizes and dtypes, and
    ``--key model`` still lists the model's tensors."""
    _training_state(tmp_path / "ckpt")
    doc = _inspect(tmp_path / "ckpt")
    keys = {row["key"]: row for row in doc["state_keys"]}
    assert list(keys) == ["model", "optimizer", "step"]
    assert keys["model"] == {"key": "model", "tensors": 4, "parameters": 8 * 16 + 16 + 16 * 4 + 4,
                             "bytes": 4 * (8 * 16 + 16 + 16 * 4 + 4), "dtypes": {"F32": 4}, "objects": 0}
    assert keys["optimizer"]["tensors"] == 12 and keys["optimizer"]["dtypes"] == {"F32": 12}  # exp_avg(_sq), step
    assert keys["step"]["objects"] == 1 and keys["step"]["tensors"] == 0
    human = invoke("inspect", tmp_path / "ckpt")
    assert human.exit_code == 0 and "training state" in human.stdout and "optimizer" in human.stdout
    model = _inspect(tmp_path / "ckpt", "--key", "model")
    assert {t["name"] for t in model["tensors"]} == {"0.weight", "0.bias", "1.weight", "1.bias"}
