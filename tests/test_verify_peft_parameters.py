"""A LoRA adapter peft writes with ``target_parameters`` on MoE experts (the gpt-oss fine-tuning
recipe: attention modules by target_modules, expert tensors by target_parameters): peft loads it
and the model runs, so verify reports no error for it, with or without its base; the modules
targeted by parameter get a note that only generic checks ran, and damage elsewhere in the same
adapter is still an error."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.support.cli import invoke

T = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gptoss")
    torch.manual_seed(0)
    cfg = T.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                         num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.GptOssForCausalLM(cfg).save_pretrained(root / "base")
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                               target_parameters=["1.mlp.experts.gate_up_proj", "1.mlp.experts.down_proj"])
        model = peft.get_peft_model(T.GptOssForCausalLM.from_pretrained(root / "base"), lora)
        model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def _codes(*args: object) -> tuple[int, dict[str, str]]:
    r = invoke("verify", "--json", *args)
    doc = json.loads(r.stdout)
    return r.exit_code, {f["code"]: f["severity"] for res in doc["results"] for f in res["findings"]}


def test_peft_loads_the_adapter_and_verify_reports_no_error(gptoss):
    base, adapter = gptoss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(T.GptOssForCausalLM.from_pretrained(base), adapter)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)
    for args in (("--base", base, adapter), ("--static", "--base", base, adapter), ("--static", adapter)):
        rc, found = _codes(*args)
        assert rc == 0 and "error" not in found.values(), (args, found)
        assert found.get("adapter.not_checked") == "info", found


def test_damage_in_the_module_loras_of_the_same_adapter_is_still_found(gptoss, tmp_path):
    from safetensors.torch import load_file, save_file

    base, adapter = gptoss
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    state = load_file(broken / "adapter_model.safetensors")
    del state["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    save_file(state, str(broken / "adapter_model.safetensors"), metadata={"format": "pt"})
    rc, found = _codes("--static", "--base", base, broken)
    assert rc == 1 and found.get("adapter.pair_missing") == "error", found
