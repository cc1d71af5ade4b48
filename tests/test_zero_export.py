"""Export from DeepSpeed ZeRO checkpoints (issue 31), held to DeepSpeed's own reconstruction.

The checkpoints are real (``tests/test_zero_build.py``: 2 ranks, Gloo, CPU accelerator, ZeRO
stages 1, 2 and 3, fp32 and bf16 training, tied and untied heads, odd element counts, frozen
parameters, several flat groups per rank); the oracle is ``get_fp32_state_dict_from_zero_checkpoint``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.support import invoke, load_with_transformers, staging_dirs
from tests.test_layering import probe
from tests.test_zero_build import NEEDS_DEEPSPEED, FIXTURES, ckpt, step, zero_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_DEEPSPEED


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _export(src: Path, dst: Path, *args: str) -> dict:
    r = invoke("export", src, dst, "--json", *args)
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def _same_as_oracle(out: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor], aliases: dict[str, str],
                    dtype: torch.dtype | None = None) -> None:
    """Every tensor of the oracle is in ``out`` (or an alias of one that is), same dtype, shape and
    bytes (the oracle cast to ``dtype`` first when given)."""
    assert set(out) | set(aliases) == set(oracle), (set(oracle) ^ (set(out) | set(aliases)))
    for name, want in oracle.items():
        got = out[aliases.get(name, name)]
        if dtype is not None and want.is_floating_point():
            want = want.to(dtype)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert _raw(got) == _raw(want), name


@pytest.mark.parametrize("name", list(FIXTURES))
def test_export_is_deepspeeds_reconstruction_bit_for_bit(zero_ckpts, tmp_path, name):
    """The Trainer's checkpoint folder exports to DeepSpeed's own fp32 reconstruction, every
    byte copied by the kernel from the rank files (nothing streamed), with the Trainer's config
    and tokenizer files; the bit16 ``model.safetensors`` beside it (stage 3: placeholders) and the
    training pickles are not what is read."""
    root = zero_ckpts[name]
    doc = _export(ckpt(root), tmp_path / "hf")
    oracle = _load(root / "oracle.safetensors")
    _same_as_oracle(_load(tmp_path / "hf" / "model.safetensors"), oracle, doc.get("aliases", {}))
    assert doc["bytes_streamed"] == 0 and doc["bytes_copied_by_kernel"] > 0
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    tied = json.loads((ckpt(root) / "config.json").read_text()).get("tie_word_embeddings", True)
    assert ("lm_head.weight" in doc.get("aliases", {})) == tied
    assert staging_dirs(tmp_path) == []


def test_a_step_folder_exports_with_the_config_of_the_folder_above(zero_ckpts, tmp_path):
    root = zero_ckpts["s3_bf16"]
    _export(step(root), tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").read_bytes() == (ckpt(root) / "config.json").read_bytes()
    _same_as_oracle(_load(tmp_path / "hf" / "model.safetensors"), _load(root / "oracle.safetensors"), {})


@pytest.mark.parametrize("name", ["s3_bf16", "s1_fp32", "s2_frozen"])
def test_exported_model_reloads_in_transformers_with_deepspeeds_logits(zero_ckpts, tmp_path, name):
    """fp32 (the default) and ``--dtype bf16`` (what users upload; converted while streamed):
    ``from_pretrained`` on the export gives the logits of the model loaded from the oracle."""
    import transformers

    root = zero_ckpts[name]
    oracle = _load(root / "oracle.safetensors")
    cfg = transformers.AutoConfig.from_pretrained(ckpt(root))
    x = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    for dtype, flag in ((torch.float32, ()), (torch.bfloat16, ("--dtype", "bf16"))):
        dst = tmp_path / str(dtype)
        doc = _export(ckpt(root), dst, *flag)
        if dtype is torch.bfloat16:
            assert doc["bytes_streamed"] > 0 and doc["bytes_copied_by_kernel"] == 0
            assert {t.dtype for t in _load(dst / "model.safetensors").values()} == {torch.bfloat16}
            _same_as_oracle(_load(dst / "model.safetensors"), oracle, doc.get("aliases", {}), torch.bfloat16)
        got = load_with_transformers(dst)
        want = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation=got.config._attn_implementation).eval()
        missing, unexpected = want.load_state_dict({k: v.to(dtype) for k, v in oracle.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        if "lm_head.weight" in missing:
            want.tie_weights()
        assert got.dtype == dtype
        with torch.no_grad():
            assert torch.equal(got(x).logits, want(x).logits)


def test_zero3_model_states_with_key_module_is_refused_not_published_as_placeholders(zero_ckpts, tmp_path):
    """The bug: ``--key module`` on a ZeRO-3 model-states file published 0-element tensors and
    exited 0. Refused now (exit 2), naming the placeholder, its real shape and the ZeRO source."""
    f = step(zero_ckpts["s3_fp32"]) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    r = invoke("export", f, tmp_path / "hf", "--key", "module")
    assert r.exit_code == 2, r.stdout + r.stderr
    assert "placeholder" in r.stderr and "[101, 33]" in r.stderr
    assert f"ckptctl export {f.parent} DST" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "hf").exists() and staging_dirs(tmp_path) == []
    # without --key, the hint names the ZeRO source too (not --key module)
    r = invoke("export", f, tmp_path / "hf")
    assert r.exit_code == 2 and f"ckptctl export {f.parent} DST" in r.stderr and "--key" not in r.stderr


def test_a_zero12_model_states_file_with_key_module_still_exports_its_bit16_weights(zero_ckpts, tmp_path):
    """Stages 1/2 save whole bit16 weights under ``module``: real tensors, not placeholders."""
    f = step(zero_ckpts["s2_bf16"]) / "mp_rank_00_model_states.pt"
    _export(f, tmp_path / "hf", "--key", "module")
    out = _load(tmp_path / "hf" / "model.safetensors")
    assert out and all(t.numel() > 0 and t.dtype == torch.bfloat16 for t in out.values())


def test_same_dtype_export_imports_neither_torch_nor_deepspeed(zero_ckpts, tmp_path):
    result, out = probe(["export", ckpt(zero_ckpts["s3_fp32"]), tmp_path / "hf", "--json"])
    assert json.loads(out)["ok"] is True
    assert result == {"exit": 0, "heavy": []}
