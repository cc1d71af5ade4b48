"""A Megatron checkpoint without its arguments (issue 43: megatron-core >= 0.17 writes no
``common.pt``; Megatron-Bridge and NeMo-RL carry no ``args``): refused without ``--config``
(never a guessed family), exact with the model's HF config.json, which is checked against the
tensors like the arguments are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import invoke, staging_dirs
from tests.test_megatron_build import NEEDS_MEGATRON, iteration
from tests.test_megatron_families import _export, _logits, exported  # noqa: F401 - the fixtures
from tests.test_megatron_families_build import family_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_MEGATRON
TOLERANCE = 1e-4


def _without_common(src: Path, tmp: Path) -> Path:
    run = tmp / "run"
    shutil.copytree(src, run)
    (iteration(run) / "common.pt").unlink()
    return run


@pytest.mark.parametrize("name,mtp", [("qwen3_tp2", None), ("qwen3_moe_dense_ep2", None), ("deepseek_tp2ep2", None),
                                      ("glm_ep2_mtp", "model.layers.2.")])
def test_without_common_pt_refused_then_exact_with_config(family_ckpts, exported, tmp_path, name, mtp):
    run = _without_common(family_ckpts[name], tmp_path)
    r = invoke("export", run, tmp_path / "refused", "--json")
    assert r.exit_code == 2, r.stdout + r.stderr
    err = json.loads(r.stdout)["error"]
    assert "there is no common.pt" in err["message"] and "--config CONFIG_JSON" in err["hint"]
    assert not (tmp_path / "refused").exists()
    config = tmp_path / "config.json"
    shutil.copy(exported[name] / "config.json", config)
    _export(run, tmp_path / "hf", "--config", str(config))
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(config.read_text())
    oracle = torch.load(family_ckpts[name] / "oracle_logits.pt")
    got = _logits(tmp_path / "hf", oracle["tokens"], mtp)
    assert (got - oracle["logits"][..., :got.shape[-1]]).abs().max().item() < TOLERANCE
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "hf" / "model.safetensors")).keys() == load_file(
        str(exported[name] / "model.safetensors")).keys()


BAD = [  # (fixture, config changes, what the message says)
    ("qwen3_tp2", dict(hidden_size=128), "--config says hidden_size = 128"),
    ("qwen3_tp2", dict(head_dim=16), "--config says (num_attention_heads + 2 x num_key_value_heads) x head_dim = 128"),
    ("qwen3_tp2", dict(model_type="gpt2"), "--config model_type 'gpt2' has no Megatron mapping"),
    ("qwen3_tp2", dict(num_hidden_layers=3), "stacks 2 layers; --config says 3"),
    ("deepseek_tp2ep2", dict(kv_lora_rank=16), "--config says kv_lora_rank + qk_rope_head_dim = 24"),
    ("glm_ep2_mtp", dict(num_nextn_predict_layers=0), "mtp.layers.0.eh_proj.weight is not covered"),
    ("glm_ep2_mtp", dict(first_k_dense_replace=0), "mlp.router.weight is missing from layer 0"),
    ("qwen3_moe_dense_ep2", dict(mlp_only_layers=[]), "mlp.router.weight is missing from layer 1"),
]


@pytest.mark.parametrize("name,changes,message", BAD)
def test_a_config_contradicting_the_tensors_is_refused_naming_the_field(family_ckpts, exported, tmp_path, name,
                                                                        changes, message):
    run = _without_common(family_ckpts[name], tmp_path)
    cfg = json.loads((exported[name] / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = invoke("export", run, tmp_path / "out", "--json", "--config", tmp_path / "config.json")
    assert r.exit_code == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert message in doc["error"]["message"], doc["error"]["message"]
    assert not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []


def test_config_is_refused_for_other_sources_and_with_vocab_size(family_ckpts, exported, tmp_path):
    r = invoke("export", exported["qwen3_tp2"], tmp_path / "a", "--config", exported["qwen3_tp2"] / "config.json")
    assert r.exit_code == 2 and "--config applies to a Megatron checkpoint" in r.stderr
    r = invoke("export", family_ckpts["qwen3_tp2"], tmp_path / "b", "--config", exported["qwen3_tp2"] / "config.json",
               "--vocab-size", "101")
    assert r.exit_code == 2 and "--vocab-size with --config" in r.stderr
    (tmp_path / "list.json").write_text("[1, 2]")
    r = invoke("export", family_ckpts["qwen3_tp2"], tmp_path / "c", "--config", tmp_path / "list.json")
    assert r.exit_code == 2 and "not a JSON object" in r.stderr
    r = invoke("export", family_ckpts["glm_ep2_mtp"], tmp_path / "d", "--names", "megatron", "--no-mtp")
    assert r.exit_code == 2 and "--no-mtp applies to the HF names" in r.stderr
    assert not any((tmp_path / n).exists() for n in "abcd")


@pytest.mark.parametrize("name", ["qwen3_tp2", "qwen3_moe_dense_ep2", "qwen3_moe_grouped_ep2"])
def test_run_config_yaml_in_place_of_the_arguments_is_exact(family_ckpts, exported, tmp_path, name):
    """A Megatron-Bridge style checkpoint: no arguments, the model's TransformerConfig in the
    iteration folder's run_config.yaml (as the worker recorded it from the model it built):
    the same export as from the arguments, byte for byte, with the same config.json."""
    run = _without_common(family_ckpts[name], tmp_path)
    shutil.copy(family_ckpts[name] / "bridge_run_config.yaml", iteration(run) / "run_config.yaml")
    _export(run, tmp_path / "hf")
    from ckptctl.manifest import sha256_file

    for f in ("model.safetensors", "config.json"):
        assert sha256_file(tmp_path / "hf" / f) == sha256_file(exported[name] / f), f


@pytest.mark.parametrize("text,message", [
    ("a: &x [1, 2]\nb: *x\n", "anchors and aliases are not read"),
    ("model: !!python/object:os.system {}\n", "not a readable run configuration"),
    ("- just a list\n", "is not a mapping"),
    ("tokenizer: {}\n", "run_config.yaml has no model section"),
])
def test_a_hostile_run_config_is_refused_without_running_anything(family_ckpts, tmp_path, text, message):
    run = _without_common(family_ckpts["qwen3_tp2"], tmp_path)
    (iteration(run) / "run_config.yaml").write_text(text)
    r = invoke("export", run, tmp_path / "out", "--json")
    assert r.exit_code == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert message in doc["error"]["message"], doc["error"]["message"]
    assert "--config" in doc["error"]["hint"] and not (tmp_path / "out").exists()
