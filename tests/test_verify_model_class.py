"""The model-class check (issue 30): breakages built from real library outputs (tests/ecosystem)
that the static rules do not see (each asserted absent under --static), found by building the
class on the meta device; for each, the library's own loader raises or reports the same keys (verify
is at least as strict). Where verify is stricter (the loader only warns) the test says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ecosystem import fresh_copy
from test_verify_ecosystem import _codes, _drop, _edit_config, _edit_tensors

from ckptctl.findings import ERROR, WARNING
from ckptctl.verify import VerifyOptions, verify_path, verify_paths

pytest_plugins = ["ecosystem.fixtures"]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
STATIC = VerifyOptions(static=True)


def _copy(build_one, name: str, tmp_path: Path) -> Path:
    return fresh_copy(build_one(name), tmp_path / name.replace("/", "_"))


def _class_findings(d: Path, code: str, **kw):
    return [f for f in verify_path(d, **kw).findings if f.code == code]


def _tf_load(d: Path, cls: str | None = None):
    """transformers' own loader: (model, loading info) of the class config.json names."""
    name = cls or json.loads((d / "config.json").read_text())["architectures"][0]
    return getattr(transformers, name).from_pretrained(d, output_loading_info=True)


def _only_static_misses(d: Path, code: str) -> None:
    """The static rules alone do not see it: the check is what finds it."""
    static = _codes(verify_path(d, options=STATIC))
    assert code not in static and ERROR not in static.values(), static


# -- transformers -----------------------------------------------------------------------------------

def test_a_norm_the_class_needs_is_missing(build_one, tmp_path: Path) -> None:
    """Stricter than the loader: transformers initialises the norm and only warns (MISSING)."""
    d = _copy(build_one, "transformers/llama", tmp_path)
    key = "model.layers.1.input_layernorm.weight"
    _edit_tensors(d, _drop(key))
    found = _class_findings(d, "config.class_missing")
    assert len(found) == 1 and found[0].severity == ERROR and found[0].details["keys"] == [key]
    assert found[0].details["cls"] == "LlamaForCausalLM"
    _only_static_misses(d, "config.class_missing")
    _, info = _tf_load(d)
    assert info["missing_keys"] == {key}


def test_a_vision_tower_layer_is_missing(build_one, tmp_path: Path) -> None:
    """A stack the static rules skip (CLIP's vision tower): a whole layer absent."""
    d = _copy(build_one, "transformers/clip", tmp_path)
    _edit_tensors(d, _drop("vision_model.encoder.layers.1."))
    found = _class_findings(d, "config.class_missing")
    assert found and all(k.startswith("vision_model.encoder.layers.1.") for k in found[0].details["keys"])
    _only_static_misses(d, "config.class_missing")
    _, info = _tf_load(d)
    assert set(found[0].details["keys"]) == set(info["missing_keys"]) and info["missing_keys"]


def test_attention_bias_switched_on_in_the_config(build_one, tmp_path: Path) -> None:
    """A config flag that adds modules: attention_bias true, no bias stored."""
    d = _copy(build_one, "transformers/llama", tmp_path)
    _edit_config(d, attention_bias=True)
    found = _class_findings(d, "config.class_missing")
    assert found and all(k.endswith("_proj.bias") for k in found[0].details["keys"])
    _only_static_misses(d, "config.class_missing")
    _, info = _tf_load(d)
    assert set(found[0].details["keys"]) == set(info["missing_keys"])


def test_a_family_saved_under_its_predecessors_config(build_one, tmp_path: Path) -> None:
    """Qwen3 weights (q/k norms) under a Qwen2 config: the trained norms are dropped and Qwen2's
    q/k/v biases are initialised. Stricter than the loader: it warns (UNEXPECTED, MISSING)."""
    d = _copy(build_one, "transformers/qwen3", tmp_path)
    _edit_config(d, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    res = verify_path(d)
    disagrees = next(f for f in res.findings if f.code == "config.class_disagrees")
    assert disagrees.severity == ERROR and disagrees.details["cls"] == "Qwen2ForCausalLM"
    assert all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in disagrees.details["keys"])
    _only_static_misses(d, "config.class_disagrees")
    _, info = _tf_load(d)
    assert set(disagrees.details["keys"]) == set(info["unexpected_keys"])
    missing = next(f for f in res.findings if f.code == "config.class_missing")
    assert set(missing.details["keys"]) == set(info["missing_keys"])


def test_per_layer_mlp_kinds_follow_the_config(build_one, tmp_path: Path) -> None:
    """DeepSeek-V3's first_k_dense_replace decides which layers hold a dense MLP and which the
    experts: saved with 1, declared 2, layer 1's experts are dropped and its dense MLP is
    initialised. Stricter than the loader, which warns (UNEXPECTED, MISSING)."""
    d = _copy(build_one, "transformers/deepseek_v3", tmp_path)
    assert json.loads((d / "config.json").read_text())["first_k_dense_replace"] == 1
    _edit_config(d, first_k_dense_replace=2)
    res = verify_path(d)
    missing = next(f for f in res.findings if f.code == "config.class_missing")
    disagrees = next(f for f in res.findings if f.code == "config.class_disagrees")
    assert all(k.startswith("model.layers.1.mlp.") for k in missing.details["keys"] + disagrees.details["keys"])
    _only_static_misses(d, "config.class_missing")
    _, info = _tf_load(d)
    assert set(missing.details["keys"]) == set(info["missing_keys"])
    assert info["unexpected_keys"] and all(k.startswith("model.layers.1.mlp.") for k in info["unexpected_keys"])


@pytest.mark.parametrize("entry, edit, key", [
    ("transformers/whisper", {"vocab_size": 100}, "model.decoder.embed_tokens.weight"),
    ("transformers/t5", {"relative_attention_num_buckets": 16},
     "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
    ("transformers/bart", {"vocab_size": 100}, "model.shared.weight"),
], ids=["whisper-vocab", "t5-buckets", "bart-resized-vocab"])
def test_shapes_outside_the_shape_checked_families(build_one, tmp_path: Path, entry: str, edit: dict,
                                                   key: str) -> None:
    """Encoder-decoders (whose shapes the static rules skip): the loader raises."""
    d = _copy(build_one, entry, tmp_path)
    _edit_config(d, **edit)
    found = {f.tensor: f for f in _class_findings(d, "config.class_shape")}
    assert key in found and found[key].severity == ERROR, sorted(found)
    _only_static_misses(d, "config.class_shape")
    with pytest.raises(RuntimeError, match="mismatch|ignore_mismatched_sizes"):
        _tf_load(d)


def test_a_head_with_another_label_count(build_one, tmp_path: Path) -> None:
    """A sequence-classification head saved for 3 labels under a config with 5."""
    d = _copy(build_one, "transformers/bert", tmp_path)
    model = transformers.BertForSequenceClassification.from_pretrained(d, num_labels=3)
    model.save_pretrained(d)
    assert "config.class_shape" not in _codes(verify_path(d))  # the clean save
    _edit_config(d, id2label={str(i): f"L{i}" for i in range(5)}, label2id={f"L{i}": i for i in range(5)})
    found = {f.tensor for f in _class_findings(d, "config.class_shape")}
    assert found == {"classifier.weight", "classifier.bias"}
    _only_static_misses(d, "config.class_shape")
    with pytest.raises(RuntimeError, match="mismatch|ignore_mismatched_sizes"):
        _tf_load(d)


def test_a_stored_tensor_with_no_place_in_the_class(build_one, tmp_path: Path) -> None:
    """A classification head beside a causal LM: dropped on load (a warning, as the loader's)."""
    d = _copy(build_one, "transformers/llama", tmp_path)

    def add(t: dict) -> None:
        t["score.weight"] = torch.ones(2, t["model.norm.weight"].shape[0])
    _edit_tensors(d, add)
    res = verify_path(d)
    assert _codes(res) .get("config.class_unused") == WARNING and ERROR not in _codes(res).values()
    _only_static_misses(d, "config.class_unused")
    _, info = _tf_load(d)
    assert info["unexpected_keys"] == {"score.weight"}


def test_remote_code_and_unknown_classes_are_notes_that_say_why(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/llama", tmp_path)
    _edit_config(d, architectures=["MyLlamaForCausalLM"], auto_map={"AutoModelForCausalLM": "my.MyLlama"})
    res = verify_path(d)
    note = next(f for f in res.findings if f.code == "config.class_not_checked")
    assert note.severity == "info" and "remote code" in note.message and "trust_remote_code" in note.message
    assert res.checks.skipped["model-class"] == note.details["reason"]
    assert "config" in res.checks.ran  # the static rules stand alone
    _edit_config(d, architectures=["LlamaForCausalLM"], auto_map=None, model_type="no_such_model")
    res = verify_path(d)
    assert "does not know model_type 'no_such_model'" in res.checks.skipped["model-class"]
    assert not [f for f in res.findings if f.severity == ERROR]


# -- diffusers and sentence-transformers ------------------------------------------------------------

def test_a_diffusers_component_config_disagrees_with_its_weights(build_one, tmp_path: Path) -> None:
    """A UNet's config.json with another cross_attention_dim: never checked before; diffusers raises."""
    pytest.importorskip("diffusers")
    from diffusers import UNet2DConditionModel

    d = _copy(build_one, "diffusers/unet", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    _edit_config(d, cross_attention_dim=cfg["cross_attention_dim"] * 2)
    found = _class_findings(d, "config.class_shape")
    assert found and all("attn2.to_k" in f.tensor or "attn2.to_v" in f.tensor for f in found)
    _only_static_misses(d, "config.class_shape")
    with pytest.raises((ValueError, RuntimeError), match="shape|size mismatch"):
        UNet2DConditionModel.from_pretrained(d)


def test_a_pipeline_component_misses_a_tensor(build_one, tmp_path: Path) -> None:
    """A pipeline root (model_index.json names the classes): the VAE without one tensor.
    Stricter than the loader: diffusers initialises it and warns ("newly initialized")."""
    pytest.importorskip("diffusers")
    import diffusers

    d = _copy(build_one, "diffusers/pipeline", tmp_path)
    vae = next(p for p in (d / "vae").iterdir() if p.suffix == ".safetensors")
    key = "decoder.conv_out.bias"
    _edit_tensors(d / "vae", _drop(key), file=vae.name)
    found = _class_findings(d, "config.class_missing")
    assert len(found) == 1 and found[0].details["keys"] == [key] and "/vae/" in found[0].path
    _only_static_misses(d, "config.class_missing")
    library, cls = json.loads((d / "model_index.json").read_text())["vae"]
    assert library == "diffusers" and found[0].details["cls"] == cls
    _, info = getattr(diffusers, cls).from_pretrained(d / "vae", output_loading_info=True)
    assert info["missing_keys"] == [key]


def test_a_sentence_transformers_module_with_another_width(build_one, tmp_path: Path) -> None:
    """The Dense module's config says another out_features: sentence-transformers raises."""
    st_lib = pytest.importorskip("sentence_transformers")
    d = _copy(build_one, "sentence-transformers/root", tmp_path)
    dense = next(p for p in d.iterdir() if p.name.endswith("_Dense"))
    cfg = json.loads((dense / "config.json").read_text())
    cfg["out_features"] += 4
    (dense / "config.json").write_text(json.dumps(cfg))
    found = {f.tensor for f in _class_findings(d, "config.class_shape")}
    assert found == {"linear.weight", "linear.bias"}
    assert "config.class_shape" not in _codes(verify_path(d, options=STATIC))
    with pytest.raises(RuntimeError, match="size mismatch"):
        st_lib.SentenceTransformer(str(d), device="cpu")


# -- the fast path (design I14): the key matching equals transformers' own function ------------------

def test_the_fast_matching_equals_the_library_function(ecosystem: dict, tmp_path: Path) -> None:
    """On every transformers checkpoint of the corpus, and on breakages of each kind (a missing
    layer, a fused-expert MoE with an expert missing, a config that disagrees, a shape), both
    matchings give the same outcome."""
    from ckptctl.verify.classes import loaded_family
    from ckptctl.verify.classes.transformers_class import check_transformers
    from ckptctl.verify.context import Context
    from ckptctl.verify.pipeline import weights_step
    from ckptctl.verify.report import PathResult
    from ckptctl.verify.screen import scan_directory

    def tensors(d: Path):
        ctx = Context(d, PathResult(str(d), str(d)), VerifyOptions())
        scan_directory(ctx)
        weights_step(ctx)
        return loaded_family(ctx).tensors

    dirs = [d for n, d in sorted(ecosystem.items()) if n.startswith("transformers/") and (d / "config.json").is_file()]
    broken = [(_copy_dir(ecosystem["transformers/mistral"], tmp_path / "a"), _drop("model.layers.1."), {}),
              (_copy_dir(ecosystem["transformers/mixtral"], tmp_path / "b"),
               _drop("model.layers.0.block_sparse_moe.experts.1."), {}),
              (_copy_dir(ecosystem["transformers/qwen3"], tmp_path / "c"), None,
               {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}),
              (_copy_dir(ecosystem["transformers/gpt2"], tmp_path / "d"), None, {"n_inner": 40}),
              # experts the loader's stack refuses (one of another shape), and one of another dtype
              (_copy_dir(ecosystem["transformers/mixtral"], tmp_path / "e"),
               _resize("model.layers.0.block_sparse_moe.experts.1.w1.weight"), {}),
              (_copy_dir(ecosystem["transformers/mixtral"], tmp_path / "f"),
               _retype("model.layers.1.block_sparse_moe.experts.2.w3.weight"), {})]
    for d, drop, edit in broken:
        if drop:
            _edit_tensors(d, drop)
        if edit:
            _edit_config(d, **edit)
        dirs.append(d)
    assert len(dirs) >= 45
    differ = 0
    for d in dirs:
        cfg = json.loads((d / "config.json").read_text())
        t = tensors(d)
        fast, ref = check_transformers(cfg, t, str(d)), check_transformers(cfg, t, str(d), fast=False)
        assert fast == ref, d
        differ += bool(fast.missing or fast.unexpected or fast.mismatched or fast.conversion)
    assert differ >= len(broken) - 1  # the breakages are seen by both (a float16 expert loads: the stack promotes it)


def _resize(key: str):
    def fn(t: dict) -> None:
        t[key] = torch.zeros(t[key].shape[0] + 1, *t[key].shape[1:], dtype=t[key].dtype)
    return fn


def _retype(key: str):
    def fn(t: dict) -> None:
        t[key] = t[key].to(torch.float16)
    return fn


def _copy_dir(src: Path, dst: Path) -> Path:
    return fresh_copy(src, dst)


# -- peft: the adapter on its base model's class -----------------------------------------------------

@pytest.fixture(scope="module")
def lora_base(tmp_path_factory) -> Path:
    """The corpus adapters' base model (make_model("llama"), seed 0), saved by transformers."""
    from ecosystem.transformers_models import make_model

    d = tmp_path_factory.mktemp("lora-base") / "base"
    make_model("llama").save_pretrained(d)
    return d


def test_a_lora_adapter_on_its_base_models_class(build_one, lora_base: Path, tmp_path: Path) -> None:
    """--base: peft builds the adapter on the base's class. A lost lora_B is reported (stricter than
    peft, which warns and leaves it at its initial value); another rank raises in peft."""
    peft = pytest.importorskip("peft")
    from ecosystem.transformers_models import make_model

    d = _copy(build_one, "peft/lora", tmp_path)
    base = VerifyOptions(base=str(lora_base))

    def verify_path(p: Path, options: VerifyOptions | None = None):  # --base is resolved by verify_paths
        return verify_paths([str(p)], options=options).results[0]

    res = verify_path(d, options=base)
    assert "model-class" in res.checks.ran and not [f for f in res.findings if f.code.startswith("config.class")]
    assert "model-class" not in verify_path(d).checks.ran  # no base known: the adapter rules alone
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _edit_tensors(d, _drop(key), file="adapter_model.safetensors")
    found = [f for f in verify_path(d, options=base).findings if f.code == "config.class_missing"]
    assert len(found) == 1 and found[0].details["keys"] == [key]
    with pytest.warns(UserWarning, match="Found missing adapter keys"):
        peft.PeftModel.from_pretrained(make_model("llama"), d)
    d2 = _copy(build_one, "peft/lora", tmp_path / "rank")
    acfg = json.loads((d2 / "adapter_config.json").read_text())
    (d2 / "adapter_config.json").write_text(json.dumps({**acfg, "r": acfg["r"] * 2}))
    assert "config.class_shape" in _codes(verify_path(d2, options=base))
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft.PeftModel.from_pretrained(make_model("llama"), d2)


def test_a_config_the_class_cannot_be_built_from(build_one, tmp_path: Path) -> None:
    """config.json is untrusted: a count of layers no class is built with is a note (the static
    rules still judge it), never a traceback or a hang; a config the library's own constructor or
    config class refuses is an error, because from_pretrained raises the same (verify is never
    looser than the loader), and the static rules still run beside it."""
    d = _copy(build_one, "transformers/llama", tmp_path)
    _edit_config(d, num_hidden_layers=10**9)
    res = verify_path(d)
    assert "1,000,000,000" in res.checks.skipped["model-class"]
    assert _codes(res)["config.class_not_checked"] == "info" and _codes(res)["config.layer_missing"] == ERROR
    _edit_config(d, num_hidden_layers=2, rope_parameters={"rope_type": "no-such-rope"})
    with pytest.raises(KeyError, match="no-such-rope"):  # the library refuses it
        _tf_load(d)
    res = verify_path(d)
    refused = next(f for f in res.findings if f.code == "config.class_refused")
    assert refused.severity == ERROR and "LlamaForCausalLM's constructor raises KeyError" in refused.message
    assert "model-class" in res.checks.ran and "config" in res.checks.ran
    assert "config.class_refused" not in _codes(verify_path(d, options=STATIC))
    _edit_config(d, rope_parameters=None, hidden_act="no-such-activation")
    with pytest.raises(KeyError, match="no-such-activation"):
        _tf_load(d)
    assert _codes(verify_path(d))["config.class_refused"] == ERROR
