"""verify on checkpoints written by the real writers: transformers save_pretrained (several
architectures, sharded and single) and huggingface_hub save_torch_state_dict. They must pass clean
(no warning, even with --deep); the same files broken in one way must be caught."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from ckptctl.verify import VerifyOptions, verify_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


def _models() -> dict[str, object]:
    t = transformers
    return {
        "llama": t.LlamaForCausalLM(t.LlamaConfig(**TINY, intermediate_size=64, num_key_value_heads=2,
                                                  max_position_embeddings=64)),
        "llama_bare": t.LlamaModel(t.LlamaConfig(**TINY, intermediate_size=64, num_key_value_heads=2)),
        "gpt2": t.GPT2LMHeadModel(t.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                               bos_token_id=0, eos_token_id=0)),
        "gpt_neox": t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**TINY, intermediate_size=64, max_position_embeddings=64)),
        "falcon": t.FalconForCausalLM(t.FalconConfig(**TINY, num_kv_heads=2, new_decoder_architecture=True)),
        "falcon_mq": t.FalconForCausalLM(t.FalconConfig(**TINY, multi_query=True)),
        "qwen2_tied": t.Qwen2ForCausalLM(t.Qwen2Config(**TINY, intermediate_size=64, num_key_value_heads=2,
                                                       tie_word_embeddings=True)),
        "mistral": t.MistralForCausalLM(t.MistralConfig(**TINY, intermediate_size=64, num_key_value_heads=1)),
        "gemma": t.GemmaForCausalLM(t.GemmaConfig(**TINY, intermediate_size=64, num_key_value_heads=1, head_dim=16)),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every model saved single-file, sharded, and (Llama) in bfloat16."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("real")
    out: dict[str, Path] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, model in _models().items():
            model.save_pretrained(root / f"{name}-single")
            model.save_pretrained(root / f"{name}-sharded", max_shard_size="40KB")
            out[f"{name}-single"] = root / f"{name}-single"
            out[f"{name}-sharded"] = root / f"{name}-sharded"
            if name == "llama":
                model.to(torch.bfloat16).save_pretrained(root / "llama-bf16", max_shard_size="40KB")
                out["llama-bf16"] = root / "llama-bf16"
    return out


def _bad(res) -> list[tuple[str, str]]:
    return [(f.code, f.message) for f in res.findings if f.severity != "info"]


def test_transformers_checkpoints_pass_clean(saved: dict[str, Path]) -> None:
    assert any(len(list(p.glob("model-*-of-*.safetensors"))) > 2 for p in saved.values())
    for name, path in saved.items():
        res = verify_path(path, options=VerifyOptions(deep=True))
        assert not _bad(res), (name, _bad(res))
        assert res.tensors > 0 and res.bytes_read == sum(f.stat().st_size for f in path.iterdir()
                                                        if f.suffix == ".safetensors")
        if name.endswith("sharded") or name == "llama-bf16":
            assert res.kind == "safetensors-sharded"


def test_config_checks_run_on_real_layouts(saved: dict[str, Path]) -> None:
    """No layout is silently skipped: every model's names are recognised by the static rules (no
    config.not_checked), and the model-class check runs on each."""
    for name, path in saved.items():
        res = verify_path(path, options=VerifyOptions(static=True))
        assert not [f for f in res.findings if f.code == "config.not_checked"], name
        assert "model-class" in verify_path(path).checks.ran, name


# static rule -> the model-class code of the same breakage
CLASS_CODES = {"config.kv_heads_mismatch": "config.class_shape", "config.position_mismatch": "config.class_shape",
               "config.mlp_shape": "config.class_shape", "config.vocab_mismatch": "config.class_shape",
               "config.attention_shape": "config.class_shape", "config.lm_head_missing": "config.class_missing",
               "config.layer_missing": "config.class_missing"}


@pytest.mark.parametrize("name,change,code", [
    ("llama-sharded", {"num_key_value_heads": 4}, "config.kv_heads_mismatch"),
    ("gpt2-sharded", {"n_positions": 32}, "config.position_mismatch"),
    ("gpt2-single", {"n_inner": 100}, "config.mlp_shape"),
    ("gpt_neox-sharded", {"vocab_size": 100}, "config.vocab_mismatch"),
    ("falcon-single", {"num_kv_heads": 4}, "config.attention_shape"),
    ("falcon_mq-sharded", {"multi_query": False}, "config.attention_shape"),
    ("qwen2_tied-single", {"tie_word_embeddings": False}, "config.lm_head_missing"),
    ("mistral-single", {"num_hidden_layers": 3}, "config.layer_missing"),
    ("gemma-sharded", {"head_dim": 8}, "config.attention_shape"),
    ("llama-bf16", {"dtype": "float32"}, "config.dtype_mismatch"),
])
def test_real_checkpoints_with_a_wrong_config_field(saved: dict[str, Path], tmp_path: Path, name: str,
                                                     change: dict, code: str) -> None:
    import shutil

    d = tmp_path / name
    shutil.copytree(saved[name], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    res = verify_path(d, options=VerifyOptions(static=True))  # the static rules (the fallback)
    assert code in {f.code for f in res.findings}, _bad(res)
    # the model-class check reports the same breakage under its own code; the rule it decides the
    # same way does not run beside it
    res = verify_path(d)
    codes = {f.code for f in res.findings}
    assert CLASS_CODES.get(code, code) in codes, _bad(res)
    assert code == "config.dtype_mismatch" or code not in codes


def test_torch_save_of_real_state_dicts_passes_clean(tmp_path: Path) -> None:
    """pytorch_model.bin as torch.save writes it: OrderedDict with _metadata, tied GPT-2 weights
    pickled twice (one storage), checked without torch."""
    torch.manual_seed(0)
    for name, model in _models().items():
        if name not in ("llama", "gpt2", "qwen2_tied"):
            continue
        d = tmp_path / name
        d.mkdir()
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(d)
        torch.save(model.state_dict(), d / "pytorch_model.bin")
        res = verify_path(d, options=VerifyOptions(deep=True))
        assert res.kind == "pytorch" and not _bad(res), (name, _bad(res))
        sd = model.state_dict()
        assert res.tensors == len({(t.untyped_storage().data_ptr(), t.storage_offset()) for t in sd.values()})
        assert res.tensors < len(sd) if name != "llama" else res.tensors == len(sd)  # tied: one alias


def test_real_sharded_checkpoint_with_a_deleted_shard(saved: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "x"
    shutil.copytree(saved["llama-sharded"], d)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    codes = {f.code for f in verify_path(d).findings}
    assert "layout.shard_missing" in codes and "config.not_checked" in codes


def test_huggingface_hub_save_torch_state_dict_passes_clean(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(0)
    emb = torch.randn(96, 32)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb,  # tied: hub drops one, records alias
             **{f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32) for i in range(4)}}
    (tmp_path / "single").mkdir()
    (tmp_path / "sharded").mkdir()
    save_torch_state_dict(dict(state), tmp_path / "single")
    save_torch_state_dict(dict(state), tmp_path / "sharded", max_shard_size=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    idx = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in idx["metadata"] or "model.embed_tokens.weight" in idx["metadata"]
    for d in (tmp_path / "single", tmp_path / "sharded"):
        res = verify_path(d, options=VerifyOptions(deep=True))
        assert not _bad(res), _bad(res)
    # the alias record must point at a stored tensor: break it
    kept = [k for k, v in idx["metadata"].items() if k != "total_size"][0]
    idx["metadata"][kept] = "model.gone.weight"
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert "metadata.alias_dangling" in {f.code for f in verify_path(tmp_path / "sharded").findings}


def test_bf16_nan_written_by_torch_is_found(saved: dict[str, Path], tmp_path: Path) -> None:
    """Real bf16/fp16 bit patterns from torch, decoded without torch."""
    from safetensors.torch import save_file

    t = torch.randn(8, 8).to(torch.bfloat16)
    t[1, 2] = float("nan")
    t[3, 3] = float("-inf")
    h = torch.randn(4, 4).to(torch.float16)
    h[0, 0] = float("inf")
    save_file({"a.weight": t, "b.weight": h, "z.weight": torch.zeros(3, 3, dtype=torch.bfloat16)},
              str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    res = verify_path(tmp_path / "x.safetensors", options=VerifyOptions(deep=True))
    got = {(f.code, f.tensor): f.details.get("count") for f in res.findings}
    assert got[("deep.nan", "a.weight")] == 1 and got[("deep.inf", "a.weight")] == 1
    assert got[("deep.inf", "b.weight")] == 1 and ("deep.all_zero", "z.weight") in got
    assert ("deep.nan", "b.weight") not in got
    assert os.path.getsize(tmp_path / "x.safetensors") == res.bytes_read


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Multi-component roots as their libraries save them: a diffusers pipeline (UNet + scheduler)
    and a sentence-transformers model (BERT, pooling, dense)."""
    diffusers = pytest.importorskip("diffusers")
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import modules as st_models
    root = tmp_path_factory.mktemp("multi")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                     block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                                     up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
        diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=10)).save_pretrained(
            root / "pipe")
        bert = root / "bert"
        transformers.BertModel(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                       num_attention_heads=2, intermediate_size=32)).save_pretrained(bert)
        (bert / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                                  + [f"t{i}" for i in range(27)]) + "\n")
        transformers.BertTokenizerFast(vocab_file=str(bert / "vocab.txt")).save_pretrained(bert)
        model = st.SentenceTransformer(modules=[st_models.Transformer(str(bert)), st_models.Pooling(16),
                                                st_models.Dense(16, 8)])
        model.save(str(root / "st"))
    return {"pipe": root / "pipe", "st": root / "st"}


def test_multi_component_roots_pass_clean_component_by_component(multi: dict[str, Path]) -> None:
    """Each component folder is verified (read, hashed); folders without weights (scheduler,
    pooling) are fine; BERT's names are not taken for Falcon's (config.not_checked, a note)."""
    for name, kind, weights in (("pipe", "diffusers-pipeline", ["unet/diffusion_pytorch_model.safetensors"]),
                                ("st", "sentence-transformers", ["model.safetensors", "2_Dense/model.safetensors"])):
        res = verify_path(multi[name], options=VerifyOptions(deep=True))
        assert not _bad(res), (name, _bad(res))
        assert res.kind == kind and res.tensors > 0
        assert sorted(f.name for f in res.files if f.role == "weights") == sorted(weights)
        assert all(f.sha256 for f in res.files if f.role == "weights")
        assert res.bytes_read == sum((multi[name] / w).stat().st_size for w in weights)


def test_a_broken_component_is_found(multi: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    d = shutil.copytree(multi["pipe"], tmp_path / "pipe")
    (d / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    codes = {(f.code, f.path) for f in verify_path(d).findings}
    assert ("dir.no_weights", str(d / "unet")) in codes
    s = shutil.copytree(multi["st"], tmp_path / "st")
    p = s / "2_Dense" / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-8])
    assert ("header.truncated", str(p)) in {(f.code, f.path) for f in verify_path(s).findings}
