"""verify --deep reads the values: damage every loader accepts at load and that breaks the model at
first use (issue 45).

- Values past float16's range in weights stored wider (float32, bfloat16) under a config whose
  dtype is float16: from_pretrained casts them to inf, and every logit is NaN
  (``deep.dtype_overflow``).
- A shard whose tail is zeros from inside a tensor to its end, as a preallocating downloader that
  stopped leaves it: size and header right, the model loads with zeros for weights
  (``deep.zero_tail``)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.support.cli import invoke

T = pytest.importorskip("transformers")


def _codes(d: Path, *args: str) -> tuple[int, dict[str, str]]:
    r = invoke("verify", d, "--json", "--static", *args)
    doc = json.loads(r.stdout)
    return r.exit_code, {f["code"]: f["severity"] for res in doc["results"] for f in res["findings"]}


def _llama(d: Path, dtype: torch.dtype, big: float | None = None) -> Path:
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = T.LlamaForCausalLM(cfg).to(dtype)
    if big is not None:
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[3, 5] = big
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(d)
    return d


def _declare(d: Path, dtype: str) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = dtype
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_values_a_float16_config_turns_into_inf_are_found_by_deep(tmp_path, stored):
    d = _llama(tmp_path / "m", stored, big=1e5)
    rc, found = _codes(d, "--deep")
    assert rc == 0 and "deep.dtype_overflow" not in found, found  # its own dtype: fine
    _declare(d, "float16")
    model = T.LlamaForCausalLM.from_pretrained(d)  # loads without a word, in float16
    assert model.dtype == torch.float16 and torch.isinf(model.model.layers[0].mlp.up_proj.weight).any()
    assert torch.isnan(model(torch.tensor([[1, 2, 3]])).logits.float()).all()  # first use: every logit NaN
    rc, found = _codes(d, "--deep")
    assert rc == 1 and found.get("deep.dtype_overflow") == "error", found
    rc, found = _codes(d)  # without --deep the values are not read
    assert "deep.dtype_overflow" not in found


def test_in_range_values_under_a_float16_config_are_not_an_overflow(tmp_path):
    d = _llama(tmp_path / "m", torch.float32, big=65000.0)  # rounds to 64992 in float16: finite
    _declare(d, "float16")
    assert not torch.isinf(T.LlamaForCausalLM.from_pretrained(d).model.layers[0].mlp.up_proj.weight).any()
    rc, found = _codes(d, "--deep")
    assert "deep.dtype_overflow" not in found, found


def _zero_tail(path: Path, fraction: float) -> None:
    """Zeros over the last ``fraction`` of the data, the size kept (a preallocated file whose
    download stopped)."""
    raw = bytearray(path.read_bytes())
    start = len(raw) - int(len(raw) * fraction)
    raw[start:] = bytes(len(raw) - start)
    path.write_bytes(bytes(raw))


def test_a_shard_whose_tail_is_zeros_is_found_by_deep(tmp_path):
    from safetensors.torch import load_file

    d = _llama(tmp_path / "m", torch.float32)
    rc, found = _codes(d, "--deep")
    assert rc == 0 and "deep.zero_tail" not in found, found
    before = {k: v.clone() for k, v in load_file(d / "model.safetensors").items()}  # not a view of the file
    _zero_tail(d / "model.safetensors", 0.3)
    after = T.LlamaForCausalLM.from_pretrained(d).state_dict()  # loads silently: the model changed
    changed = [k for k, v in before.items() if k in after and not torch.equal(after[k], v)]
    assert changed and any(bool((after[k] == 0).all()) for k in changed)
    rc, found = _codes(d)
    assert "deep.zero_tail" not in found  # headers and sizes are right: only the values tell
    rc, found = _codes(d, "--deep")
    assert rc == 1 and found.get("deep.zero_tail") == "error", found


def test_an_adapter_ending_in_its_zero_lora_b_is_not_a_zero_tail(tmp_path):
    """A fresh LoRA adapter's B matrices are zeros, and one can end the file: its zero run starts
    where that tensor starts, which is not a stopped download."""
    peft = pytest.importorskip("peft")
    base = _llama(tmp_path / "base", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = peft.get_peft_model(T.LlamaForCausalLM.from_pretrained(base), peft.LoraConfig(r=2, target_modules=["q_proj"]))
        m.save_pretrained(tmp_path / "adapter")
    rc, found = _codes(tmp_path / "adapter", "--deep")
    assert "deep.zero_tail" not in found and "error" not in found.values(), found
