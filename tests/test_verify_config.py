"""config.json and PEFT rules on tensor metadata: peft's matching semantics, nested configs, skips."""

from __future__ import annotations

from pathlib import Path

import pytest

import corpus
from ckptctl.format.tensor import TensorSpec
from ckptctl.verify import VerifyOptions, verify_path
from ckptctl.verify.model import check_config
from ckptctl.verify.peft import check_adapter, peft_rank, peft_target_match

Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("cfg,key,expected", [
    ({"target_modules": ["q_proj"]}, Q, True),
    ({"target_modules": ["q_proj"]}, "model.layers.0.self_attn.xq_proj", False),  # '.name' suffix, not substring
    ({"target_modules": ["q_proj"]}, "model.layers.0.self_attn.q_proj.inner", False),
    ({"target_modules": [Q]}, Q, True),  # exact name
    ({"target_modules": r".*layers\.0\..*q_proj"}, Q, True),  # regex: fullmatch
    ({"target_modules": r"q_proj"}, Q, False),  # a string never matches as a suffix
    ({"target_modules": ["q_proj"], "exclude_modules": ["layers.0.self_attn.q_proj"]}, Q, False),
    ({"target_modules": ["q_proj"], "exclude_modules": r".*\.0\..*"}, Q, False),
    ({"target_modules": ["q_proj"], "layers_to_transform": [1]}, Q, False),
    ({"target_modules": ["q_proj"], "layers_to_transform": [0]}, Q, True),
    ({"target_modules": ["q_proj"], "layers_to_transform": 0, "layers_pattern": "layers"}, Q, True),
    ({"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": ["blocks"]}, Q, False),
    ({"target_modules": "all-linear"}, Q, True),
])
def test_peft_target_matching(cfg: dict, key: str, expected: bool) -> None:
    assert peft_target_match(cfg, key) is expected


def test_peft_rank_pattern() -> None:
    cfg = {"r": 8, "rank_pattern": {"v_proj": 2, r"layers\.1\.self_attn\.q_proj": 4}}
    assert peft_rank(cfg, "model.layers.0.self_attn.v_proj") == 2
    assert peft_rank(cfg, "model.layers.1.self_attn.q_proj") == 4
    assert peft_rank(cfg, Q) == 8
    assert peft_rank(cfg, "model.layers.0.self_attn.xv_proj") == 8  # pattern must start at a '.' boundary


def test_adapter_with_rank_pattern_and_layer_selection_is_clean(tmp_path: Path) -> None:
    d = tmp_path / "a"
    mods = {m: s for m, s in corpus.llama_lora_modules().items() if ".1." in m}
    ranks = {m: (2 if m.endswith("v_proj") else 4) for m in mods}
    cfg = corpus.adapter_config(corpus.base_for(d), rank_pattern={"v_proj": 2}, layers_to_transform=[1])
    corpus.write_adapter(d, corpus.lora_tensors(mods, ranks), cfg)
    res = verify_path(d, options=VerifyOptions(deep=True))
    assert not [f for f in res.findings if f.severity != "info"], res.findings
    # The same tensors with layers_to_transform=[0]: every module is now untargeted, layer 0 is missing.
    cfg["layers_to_transform"] = [0]
    corpus.write_adapter(d, corpus.lora_tensors(mods, ranks), cfg)
    codes = {f.code for f in verify_path(d).findings}
    assert {"adapter.untargeted_key", "adapter.missing_keys"} <= codes


def test_dora_modules_to_save_and_embedding_lora_are_understood() -> None:
    t = {}
    for name, shape in {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (16, 4),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": (16,),
        "base_model.model.model.embed_tokens.lora_embedding_A": (4, 64),
        "base_model.model.model.embed_tokens.lora_embedding_B": (16, 4),
        "base_model.model.score.weight": (2, 16),
    }.items():
        t[name] = TensorSpec(name, "F32", shape)
    base = {n: TensorSpec(n, "F32", s) for n, s in {
        "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.embed_tokens.weight": (64, 16)}.items()}
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": "x", "use_dora": True,
           "target_modules": ["q_proj", "embed_tokens"], "modules_to_save": ["score"]}
    assert [f for f in check_adapter("a", cfg, t, base=base) if f.severity != "info"] == []
    bad = check_adapter("a", {**cfg, "modules_to_save": None}, t, base=base)
    assert {f.code for f in bad} == {"adapter.unexpected_key"}


def _meta(shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> dict[str, TensorSpec]:
    return {n: TensorSpec(n, dtype, s) for n, s in shapes.items()}


def test_multimodal_text_config_and_prefix() -> None:
    """A VLM: dims in text_config, the text tower under model.language_model., a vision tower whose
    layers must not be counted as text layers."""
    shapes: dict[str, tuple[int, ...]] = {"model.language_model.embed_tokens.weight": (64, 16),
                                          "lm_head.weight": (64, 16)}
    for i in range(2):
        p = f"model.language_model.layers.{i}.self_attn."
        shapes.update({p + "q_proj.weight": (16, 16), p + "k_proj.weight": (8, 16), p + "v_proj.weight": (8, 16),
                       p + "o_proj.weight": (16, 16)})
    for i in range(5):
        shapes[f"model.vision_tower.encoder.layers.{i}.self_attn.q_proj.weight"] = (24, 24)
    cfg = {"architectures": ["XForConditionalGeneration"], "model_type": "x", "dtype": "bfloat16",
           "tie_word_embeddings": False,
           "text_config": {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 2, "vocab_size": 64}}
    assert [f for f in check_config("c", cfg, _meta(shapes)) if f.severity != "info"] == []
    cfg["text_config"]["num_key_value_heads"] = 1
    assert "config.kv_heads_mismatch" in {f.code for f in check_config("c", cfg, _meta(shapes))}
    # a text tower of a family whose layout the rules do not know: counted, not shape-checked, said so
    cfg["text_config"]["model_type"] = "x_text"
    found = check_config("c", cfg, _meta(shapes))
    assert [f.code for f in found if f.severity != "info"] == []
    assert any(f.code == "config.not_checked" and "'x'" in f.message for f in found)


def test_quantized_and_encoder_decoder_checkpoints_skip_shapes() -> None:
    shapes = {"model.embed_tokens.weight": (64, 16), "model.layers.0.self_attn.q_proj.weight": (7, 3),
              "model.layers.0.self_attn.q_proj.weight_scale_inv": (1, 1)}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "num_attention_heads": 4,
           "num_hidden_layers": 1, "vocab_size": 64, "quantization_config": {"quant_method": "fp8"}}
    codes = {f.code for f in check_config("c", cfg, _meta(shapes, "F8_E4M3"))}
    assert "config.attention_shape" not in codes and "config.not_checked" in codes
    assert "config.quantization_unused" not in codes
    enc = {f.code for f in check_config("c", {**cfg, "is_encoder_decoder": True}, _meta(shapes))}
    assert enc <= {"config.not_checked", "config.quantization_unused"}


@pytest.mark.parametrize("alpha", ["null", "absent"])
def test_lora_alpha_null_is_an_error_absent_a_warning_as_peft_loads_them(tmp_path: Path, alpha: str) -> None:
    """peft falls back to its default lora_alpha only when the key is absent; an explicit null is
    passed on and loading raises TypeError. Checked with the real peft loader."""
    import json
    import warnings

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "adapter"
    corpus.make_clean_adapter(d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    if alpha == "null":
        cfg["lora_alpha"] = None
    else:
        del cfg["lora_alpha"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    found = [(f.code, f.severity, f.details.get("field")) for f in verify_path(d).findings
             if f.code == "adapter.missing_optional"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"])
        if alpha == "null":
            assert found == [("adapter.missing_optional", "error", "lora_alpha")]
            with pytest.raises(TypeError):
                peft.PeftModel.from_pretrained(base, str(d))
        else:
            assert found == [("adapter.missing_optional", "warning", "lora_alpha")]
            peft.PeftModel.from_pretrained(base, str(d))  # loads, with peft's default
