"""Export of the newer Megatron families (issue 43): Qwen3 (QK norms, TP2), Qwen3-MoE
(sequential and grouped experts, EP2), DeepSeek-V3 (MLA, YaRN, a dense first layer, group routing,
shared expert, expert bias; TP2 x EP2; per-layer keys) and GLM-4.5 (QKV bias, QK norms, partial
rotary, an MTP layer; EP2; per-layer keys), judged by transformers' own loader against Megatron's own
forward (``tests/test_megatron_families_build.py``); the vocabulary the run's tokenizer had; every
argument a tensor determines checked against it, refused naming the argument."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import invoke, staging_dirs
from tests.test_megatron_build import NEEDS_MEGATRON, iteration, rewrite_args
from tests.test_megatron_families_build import NAMES, family_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_MEGATRON
TOLERANCE = 1e-4
EXPECTED = {  # architecture, vocabulary exported, a tensor only this family has
    "qwen3_tp2": ("Qwen3ForCausalLM", 102, "model.layers.1.self_attn.q_norm.weight"),
    "qwen3_moe_ep2": ("Qwen3MoeForCausalLM", 102, "model.layers.1.mlp.experts.3.up_proj.weight"),
    "qwen3_moe_grouped_ep2": ("Qwen3MoeForCausalLM", 128, "model.layers.0.mlp.experts.0.down_proj.weight"),
    "qwen3_moe_dense_ep2": ("Qwen3MoeForCausalLM", 102, "model.layers.1.mlp.gate_proj.weight"),
    "deepseek_tp2ep2": ("DeepseekV3ForCausalLM", 102, "model.layers.1.mlp.gate.e_score_correction_bias"),
    "glm_ep2_mtp": ("Glm4MoeForCausalLM", 102, "model.layers.2.eh_proj.weight"),
}
MTP_LAYER = {"glm_ep2_mtp": "model.layers.2."}  # transformers ignores the MTP layer (unexpected keys)


def _export(src: Path, dst: Path, *args: str) -> dict:
    r = invoke("export", src, dst, "--json", "--no-fsync", *args)
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def _logits(model_dir: Path, tokens: torch.Tensor, mtp: str | None = None) -> torch.Tensor:
    """transformers' model on the export: nothing missing or mismatched, nothing unexpected but
    the MTP layer (under ``mtp``) when there is one."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                    output_loading_info=True)
    unexpected = set(info.get("unexpected_keys") or ())
    assert not info.get("missing_keys") and not info.get("mismatched_keys"), info
    assert all(mtp and k.startswith(mtp) for k in unexpected) and bool(unexpected) == bool(mtp), unexpected
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
    got = _logits(exported[name], oracle["tokens"], MTP_LAYER.get(name))
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
    dense = json.loads((exported["qwen3_moe_dense_ep2"] / "config.json").read_text())
    assert dense["mlp_only_layers"] == [1] and dense["intermediate_size"] == 96  # moe_layer_freq [1, 0, 1]


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


_common = rewrite_args


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


def test_deepseek_and_glm_configs_say_what_megatron_ran(exported):
    ds = json.loads((exported["deepseek_tp2ep2"] / "config.json").read_text())
    assert (ds["q_lora_rank"], ds["kv_lora_rank"], ds["qk_nope_head_dim"], ds["qk_rope_head_dim"], ds["v_head_dim"]) == (
        32, 24, 16, 8, 16)
    assert ds["first_k_dense_replace"] == 1 and ds["n_group"] == 2 and ds["topk_group"] == 1
    assert ds["routed_scaling_factor"] == 2.5 and ds["n_shared_experts"] == 1 and ds["num_nextn_predict_layers"] == 0
    assert ds["rope_parameters"]["rope_type"] == "yarn" and ds["rope_parameters"]["factor"] == 4.0
    glm = json.loads((exported["glm_ep2_mtp"] / "config.json").read_text())
    assert glm["partial_rotary_factor"] == 0.5 and glm["use_qk_norm"] and glm["attention_bias"]
    assert glm["num_nextn_predict_layers"] == 1 and glm["num_hidden_layers"] == 2


def test_the_mtp_layer_is_published_as_hf_holds_it_and_no_mtp_leaves_it_out(family_ckpts, exported, tmp_path):
    """The MTP layer is model.layers.{num_hidden_layers + k} with eh_proj, enorm, hnorm,
    shared_head.norm and its decoder layer's tensors; ``--no-mtp`` leaves it out on purpose (and
    says 0 in config.json): transformers then loads every key and gives the same logits."""
    from safetensors import safe_open

    with safe_open(str(exported["glm_ep2_mtp"] / "model.safetensors"), "pt") as f:
        mtp = sorted(k for k in f.keys() if k.startswith("model.layers.2."))
    for own in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "self_attn.q_proj.bias",
                "mlp.experts.3.down_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert "model.layers.2." + own in mtp, own
    _export(family_ckpts["glm_ep2_mtp"], tmp_path / "no-mtp", "--no-mtp")
    cfg = json.loads((tmp_path / "no-mtp" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 0
    oracle = torch.load(family_ckpts["glm_ep2_mtp"] / "oracle_logits.pt")
    got = _logits(tmp_path / "no-mtp", oracle["tokens"])
    assert (got - oracle["logits"][..., :102]).abs().max().item() < TOLERANCE


def _drop(folder: Path, prefix: str) -> None:
    """Remove every tensor named from ``prefix`` from the DCP metadata (as a save that lost them)."""
    import pickle

    meta_path = folder / ".metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    for name in [n for n in meta.state_dict_metadata if n.startswith(prefix)]:
        del meta.state_dict_metadata[name]
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)


HOSTILE = [  # (fixture, how it is broken, what the message says)
    ("deepseek_tp2ep2", lambda d: _drop(d, "decoder.layers.1."),
     "layer 1 (decoder.layers.1.*) is missing; the arguments say 2 layers (num_layers)"),
    ("deepseek_tp2ep2", lambda d: _drop(d, "decoder.layers.1.mlp.router.expert_bias"),
     "mlp.router.expert_bias is missing from layer 1, MoE by moe_layer_freq"),
    ("glm_ep2_mtp", lambda d: _drop(d, "mtp.layers.0.enorm"), "enorm.weight is missing from MTP layer 0"),
    ("glm_ep2_mtp", lambda d: _drop(d, "mtp."), "MTP layer 0 (mtp.layers.0.*) is missing"),
    ("deepseek_tp2ep2", lambda d: _common(d, kv_lora_rank=16),
     "but the arguments say kv_lora_rank + qk_pos_emb_head_dim = 24"),
    ("deepseek_tp2ep2", lambda d: _common(d, q_lora_rank=48), "but the arguments say q_lora_rank = 48"),
    ("deepseek_tp2ep2", lambda d: _common(d, v_head_dim=8), "num_attention_heads x (qk_head_dim + v_head_dim) = 96"),
    ("deepseek_tp2ep2", lambda d: _common(d, moe_shared_expert_intermediate_size=64),
     "2 x moe_shared_expert_intermediate_size = 128"),
    ("deepseek_tp2ep2", lambda d: _common(d, moe_layer_freq=[1, 1]), "mlp.router.weight is missing from layer 0, MoE by moe_layer_freq"),
    ("deepseek_tp2ep2", lambda d: _common(d, moe_layer_freq=[1, 0]), "puts dense layers after MoE layers"),
    ("deepseek_tp2ep2", lambda d: _common(d, moe_router_group_topk=2),
     "moe_router_topk=2 over moe_router_group_topk=2 scores each group by its top 1"),
    ("glm_ep2_mtp", lambda d: _common(d, mtp_num_layers=2), "MTP layer 1 (mtp.layers.1.*) is missing"),
    ("glm_ep2_mtp", lambda d: _common(d, mtp_num_layers=None), "mtp.layers.0.eh_proj.weight is not covered"),
]


@pytest.mark.parametrize("case", range(len(HOSTILE)), ids=[h[2][:40] for h in HOSTILE])
def test_broken_per_layer_and_mtp_checkpoints_are_refused(family_ckpts, tmp_path, case):
    name, brake, message = HOSTILE[case]
    src = tmp_path / "run"
    shutil.copytree(family_ckpts[name], src)
    brake(iteration(src))
    r = invoke("export", src, tmp_path / "out", "--json")
    assert r.exit_code == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert message in doc["error"]["message"], doc["error"]["message"]
    assert doc["error"]["hint"] and not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []


def test_an_export_keeping_a_padded_vocabulary_says_so(family_ckpts, tmp_path):
    """A tokenizer whose size the arguments do not give: every padded row is exported (none that
    training could have touched is dropped) and the export's result says so, with --vocab-size."""
    name = "qwen3_moe_grouped_ep2"
    r = invoke("export", family_ckpts[name], tmp_path / "hf", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    notes = json.loads(r.stdout)["notes"]
    assert len(notes) == 1 and "--vocab-size" in notes[0]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 128
    r = invoke("export", family_ckpts[name], tmp_path / "hf2")
    assert r.exit_code == 0 and "note: " in r.stderr and "--vocab-size" in r.stderr, r.stderr
