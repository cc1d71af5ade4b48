"""transformers loads what export writes and computes the same logits (I5: loader agreement)."""

from __future__ import annotations


import pytest
import torch

from tests.support import load_hub, run_ckptctl, same
from tests.support import load_glob as load_dir
from tests.support import tiny_llama as _tiny_llama

transformers = pytest.importorskip("transformers")


def _logits(model):
    ids = torch.arange(0, 24).reshape(2, 12) % 128
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("tie", [False, True])
def test_from_bin_sharded_and_fp16_give_same_logits(tmp_path, tie):
    model = _tiny_llama(tie)
    ref = _logits(model)
    src = tmp_path / "bin"
    src.mkdir()
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    model.config.save_pretrained(src)

    run_ckptctl("export", str(src), str(tmp_path / "a"), check=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=0)

    model.save_pretrained(tmp_path / "st", max_shard_size="20KB")
    assert len(list((tmp_path / "st").glob("model-*.safetensors"))) > 1
    run_ckptctl("export", str(tmp_path / "st"), str(tmp_path / "b"), "--max-shard-size", "50KB", check=True)
    assert same(load_dir(tmp_path / "b"), load_hub(tmp_path / "b"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    torch.testing.assert_close(_logits(loaded), ref, rtol=0, atol=0)

    run_ckptctl("export", str(tmp_path / "st"), str(tmp_path / "c"), "--dtype", "fp16", check=True)
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.float16).eval()
    assert next(half.parameters()).dtype == torch.float16
    expected = {k: v.half() for k, v in model.state_dict().items()}
    got = half.state_dict()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k  # bit-exact fp16 weights
    ref_half = _logits(model.half())
    # weights are bit-exact above; the two fp16 models differ only in fp32 buffers (rotary)
    torch.testing.assert_close(_logits(half), ref_half, rtol=1e-2, atol=1e-3)
    assert '"float16"' in (tmp_path / "c" / "config.json").read_text()
