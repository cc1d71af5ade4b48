"""Export of the newer Megatron families (issue 43): Qwen3 (QK norms, TP2) and Qwen3-MoE
(sequential and grouped experts, EP2), judged by transformers' own loader against Megatron's own
forward (``tests/test_megatron_families_build.py``); the vocabulary the run's tokenizer had; every
argument a tensor determines checked against it, refused naming the argument."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import invoke, staging_dirs
from tests.test_megatron_build import NEEDS_MEGATRON, iteration
from tests.test_megatron_families_build import NAMES, family_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_MEGATRON
TOLERANCE = 1e-4
EXPECTED = {  # architecture, vocabulary exported, a tensor only this family has
    "qwen3_tp2": ("Qwen3ForCausalLM", 102, "model.layers.1.self_attn.q_norm.weight"),
    "qwen3_moe_ep2": ("Qwen3MoeForCausalLM", 102, "model.layers.1.mlp.experts.3.up_proj.weight"),
    "qwen3_moe_grouped_ep2": ("Qwen3MoeForCausalLM", 128, "model.layers.0.mlp.experts.0.down_proj.weight"),
}


def _export(src: Path, dst: Path, *args: str) -> dict:
    r = invoke("export", src, dst, "--json", "--no-fsync", *args)
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def _logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def exported(family_ckpts, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("families-hf")
    for name in NAMES:
        _export(family_ckpts[name], out / name)
    return {name: out / name for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_transformers_gives_megatrons_own_logits(family_ckpts, exported, name):
    """Nothing missing, unexpected or mismatched, and Megatron's logits over the vocabulary the
    run's tokenizer had: the NullTokenizer's EOD row (vocab_size + 1) kept, a HuggingFaceTokenizer
    (size not in the arguments) keeps every padded row."""
    arch, vocab, own = EXPECTED[name]
    oracle = torch.load(family_ckpts[name] / "oracle_logits.pt")
    got = _logits(exported[name], oracle["tokens"])
    assert got.shape[-1] == vocab
    assert (got - oracle["logits"][..., :vocab]).abs().max().item() < TOLERANCE
    cfg = json.loads((exported[name] / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["vocab_size"] == vocab
    from safetensors import safe_open

    with safe_open(str(exported[name] / "model.safetensors"), "pt") as f:
        assert own in f.keys()


def test_qwen3_head_dim_is_kv_channels_not_hidden_over_heads(exported):
    cfg = json.loads((exported["qwen3_tp2"] / "config.json").read_text())
    assert cfg["head_dim"] == 24 and cfg["hidden_size"] // cfg["num_attention_heads"] == 16
    moe = json.loads((exported["qwen3_moe_ep2"] / "config.json").read_text())
    assert moe["num_experts"] == 4 and moe["moe_intermediate_size"] == 32 and moe["norm_topk_prob"] is True
    assert moe["decoder_sparse_step"] == 1 and moe["mlp_only_layers"] == []


def test_vocab_size_trims_what_the_arguments_do_not_give(family_ckpts, tmp_path):
    """``--vocab-size N`` keeps the first N rows (the padded size was kept, with a note inspect
    shows); more than the stored rows is a usage error, nothing published."""
    name = "qwen3_moe_grouped_ep2"
    r = invoke("inspect", family_ckpts[name], "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    notes = json.loads(r.stdout)["megatron"]["notes"]
    assert len(notes) == 1 and "tokenizer_type='HuggingFaceTokenizer'" in notes[0] and "--vocab-size" in notes[0]
    _export(family_ckpts[name], tmp_path / "hf", "--vocab-size", "101")
    oracle = torch.load(family_ckpts[name] / "oracle_logits.pt")
    got = _logits(tmp_path / "hf", oracle["tokens"])
    assert got.shape[-1] == 101 and (got - oracle["logits"][..., :101]).abs().max().item() < TOLERANCE
    r = invoke("export", family_ckpts[name], tmp_path / "big", "--vocab-size", "129", "--json")
    assert r.exit_code == 2 and "--vocab-size 129 does not fit the 128 stored rows" in json.loads(r.stdout)[
        "error"]["message"]
    assert not (tmp_path / "big").exists()


def _common(folder: Path, **changes) -> None:
    path = folder / "common.pt"
    obj = torch.load(path, weights_only=False)
    args = vars(obj["args"]).copy()
    args.update(changes)
    obj["args"] = argparse.Namespace(**args)
    torch.save(obj, path)


CONTRADICTIONS = [  # (fixture, changed arguments, what the message says)
    ("qwen3_tp2", dict(hidden_size=128), "in dimension 1 of [128, 64], but the arguments say hidden_size = 128"),
    ("qwen3_tp2", dict(ffn_hidden_size=64), "has 192 in dimension 0 of [192, 64], but the arguments say "
                                            "2 x ffn_hidden_size = 128"),
    ("qwen3_tp2", dict(kv_channels=16), "(num_attention_heads + 2 x num_query_groups) x kv_channels = 128"),
    ("qwen3_tp2", dict(num_attention_heads=8, num_query_groups=4),
     "(num_attention_heads + 2 x num_query_groups) x kv_channels = 384"),
    ("qwen3_moe_ep2", dict(moe_ffn_hidden_size=48), "but the arguments say 2 x moe_ffn_hidden_size = 96"),
    ("qwen3_moe_ep2", dict(num_experts=8), "but the arguments say num_experts = 8"),
    ("qwen3_moe_ep2", dict(num_layers=3), "stacks 2 layers; the arguments say 3"),
    ("qwen3_tp2", dict(vocab_size=200), "vocab_size=200) does not fit padded_vocab_size=128"),
]


@pytest.mark.parametrize("name,changes,message", CONTRADICTIONS)
def test_arguments_contradicting_the_tensors_are_refused_naming_the_argument(family_ckpts, tmp_path, name,
                                                                             changes, message):
    src = tmp_path / "run"
    shutil.copytree(family_ckpts[name], src)
    _common(iteration(src), **changes)
    r = invoke("export", src, tmp_path / "out", "--json")
    assert r.exit_code == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert message in doc["error"]["message"], doc["error"]["message"]
    assert not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []
