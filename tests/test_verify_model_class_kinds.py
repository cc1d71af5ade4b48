"""The model-class check (issue 30) on the kinds of model that tests/test_verify_model_class.py does
not cover: a CTC head, persistent and non-persistent buffers, hybrid attention/SSM stacks whose
per-layer kind comes from the config, stacks nested in stages, and config fields that offset which
layers hold experts. Each tiny model is built by transformers from its config class and written by
``save_pretrained`` (once per module); each breakage is found by the class check, missed by the
static rules alone (``VerifyOptions(static=True)``), and judged by the library's own loader
(``from_pretrained(..., output_loading_info=True)``): it raises (verify is equal) or reports the same
keys and only warns (verify is stricter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ecosystem import fresh_copy
from test_verify_ecosystem import _codes, _drop, _edit_config, _edit_tensors

from ckptctl.findings import ERROR, WARNING
from ckptctl.verify import VerifyOptions, verify_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
STATIC = VerifyOptions(static=True)
DEC = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
       "num_attention_heads": 2, "num_key_value_heads": 1}
MAMBA2 = {"mamba_n_heads": 2, "mamba_d_head": 16, "mamba_d_state": 4, "mamba_d_conv": 2, "mamba_n_groups": 1,
          "mamba_chunk_size": 16}
# name -> (model class, config class, config fields): tiny, 1-2 layers, hidden 8-16
MODELS = {
    "wav2vec2-ctc": ("Wav2Vec2ForCTC", "Wav2Vec2Config", {
        "vocab_size": 12, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32, "conv_dim": (8, 8), "conv_stride": (5, 2), "conv_kernel": (10, 3),
        "num_conv_pos_embeddings": 4, "num_conv_pos_embedding_groups": 2}),
    "resnet": ("ResNetForImageClassification", "ResNetConfig",
               {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "num_labels": 3}),
    "swin": ("SwinForImageClassification", "SwinConfig", {
        "image_size": 32, "patch_size": 4, "embed_dim": 8, "depths": [2, 1], "num_heads": [1, 2], "window_size": 2,
        "num_labels": 3}),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig",
                 {"num_stages": 2, "hidden_sizes": [8, 16], "depths": [2, 1], "num_labels": 3}),
    # layer 0 mamba with a dense MLP, layer 1 attention with the experts
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(
        DEC, num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2)),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(DEC, layer_types=["conv", "full_attention"], conv_L_cache=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        DEC, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2, num_experts_per_tok=1,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "bamba": ("BambaForCausalLM", "BambaConfig", dict(DEC, attn_layer_indices=[1], **MAMBA2)),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", dict(
        DEC, num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=16,
        layer_types=["mamba", "attention"], **MAMBA2)),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        DEC, head_dim=8, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=2,
        num_experts_per_tok=1, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=2, layer_types=["linear_attention", "full_attention"])),
}


class Built:
    """``built(name) -> Path``: the model built and saved on first use, once per module;
    ``nonpersistent[name]``: its buffers that the state dict leaves out."""

    def __init__(self, root: Path) -> None:
        self.root, self.paths, self.nonpersistent = root, {}, {}

    def __call__(self, name: str) -> Path:
        if name not in self.paths:
            cls, cfg_cls, fields = MODELS[name]
            torch.manual_seed(0)
            model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**fields))
            names = set(model.state_dict())
            self.nonpersistent[name] = sorted(k for k, _ in model.named_buffers() if k not in names)
            model.save_pretrained(self.root / name)
            self.paths[name] = self.root / name
        return self.paths[name]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("class-kinds"))


def _copy(built: Built, name: str, tmp_path: Path) -> Path:
    return fresh_copy(built(name), tmp_path / name)


def _load(d: Path, **kw):
    """transformers' own loader: (model, loading info) of the class config.json names."""
    name = json.loads((d / "config.json").read_text())["architectures"][0]
    return getattr(transformers, name).from_pretrained(d, output_loading_info=True, **kw)


def _stored(d: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(d / "model.safetensors", "pt") as f:
        return set(f.keys())


def _keys(res, code: str) -> set[str]:
    found = [f for f in res.findings if f.code == code]
    for f in found:
        assert f.severity == ERROR and f.details["count"] == len(f.details["keys"]), f
    return {k for f in found for k in f.details["keys"]}


def _only_static_misses(d: Path, *codes: str) -> None:
    """The static rules alone do not see it: the class check is what finds it."""
    static = _codes(verify_path(d, options=STATIC))
    assert not set(codes) & set(static) and ERROR not in static.values(), static


def _same_as_loader(d: Path) -> tuple[set[str], set[str]]:
    """verify's missing and disagreeing keys, each equal to what the loader reports (it warns)."""
    res = verify_path(d)
    missing, disagrees = _keys(res, "config.class_missing"), _keys(res, "config.class_disagrees")
    assert "config.class_unused" not in _codes(res)
    _, info = _load(d)
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert missing == set(info["missing_keys"])
    unexpected, stored = set(info["unexpected_keys"]), _stored(d)
    if not unexpected <= stored:  # the loader names them after its renames and fusions: verify as stored
        assert disagrees <= stored and len(disagrees) >= len(unexpected) and unexpected & stored <= disagrees
    else:
        assert disagrees == unexpected
    return missing, disagrees


# -- clean saves: no error, no warning, with and without the class check ---------------------------

CLEAN = list(MODELS)


@pytest.mark.parametrize("name", CLEAN)
def test_a_clean_save_verifies_clean(built: Built, name: str) -> None:
    """Every model built here: the class check runs and finds nothing, the static rules alone find
    no error or warning, and the loader reports nothing."""
    d = built(name)
    for options in (None, STATIC):
        res = verify_path(d, options=options)
        bad = [(f.code, f.message) for f in res.findings if f.severity in (ERROR, WARNING)]
        assert not bad, (options, bad)
    assert "model-class" in verify_path(d).checks.ran, verify_path(d).checks.skipped
    _, info = _load(d)
    assert not any(info.values()), info


# -- 1. a CTC head under another vocabulary --------------------------------------------------------

def test_a_ctc_head_under_another_vocab(built: Built, tmp_path: Path) -> None:
    """Wav2Vec2ForCTC saved with 12 letters, config.json says 20: the CTC head's weight and bias.
    Equal to the loader: transformers raises (ignore_mismatched_sizes is False); told to ignore
    sizes it reports the same keys and shapes as mismatched."""
    d = _copy(built, "wav2vec2-ctc", tmp_path)
    _edit_config(d, vocab_size=20)
    found = {(f.tensor, tuple(f.details["stored"]), tuple(f.details["expected"]))
             for f in verify_path(d).findings if f.code == "config.class_shape" and f.severity == ERROR}
    assert found == {("lm_head.weight", (12, 16), (20, 16)), ("lm_head.bias", (12,), (20,))}
    _only_static_misses(d, "config.class_shape")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        _load(d)
    _, info = _load(d, ignore_mismatched_sizes=True)
    assert {(k, tuple(a), tuple(b)) for k, a, b in info["mismatched_keys"]} == found


# -- 2. buffers: persistent ones are needed, non-persistent ones never -----------------------------

@pytest.mark.parametrize("suffix", ["running_mean", "running_var", "num_batches_tracked"])
def test_a_batch_norm_running_stat_is_missing(built: Built, tmp_path: Path, suffix: str) -> None:
    """ResNet's BatchNorm statistics are persistent buffers: one dropped from the file (in a stage,
    not the stem). Stricter than the loader: transformers re-initialises it and warns (MISSING)."""
    d = _copy(built, "resnet", tmp_path)
    key = f"resnet.encoder.stages.1.layers.0.layer.1.normalization.{suffix}"
    _edit_tensors(d, _drop(key))
    assert _same_as_loader(d) == ({key}, set())
    _only_static_misses(d, "config.class_missing")


@pytest.mark.parametrize("name", ["swin", "qwen2_moe"])
def test_non_persistent_buffers_are_not_demanded(built: Built, tmp_path: Path, name: str) -> None:
    """Swin's relative_position_index and the rotary inv_freq are non-persistent buffers: not in a
    clean save and not demanded; a stale inv_freq an older transformers stored is ignored, as the
    loader ignores it (no finding at all: equal to the loader, which loads silently)."""
    d = built(name)
    assert built.nonpersistent[name] and not _stored(d) & set(built.nonpersistent[name])
    assert "model-class" in verify_path(d).checks.ran
    assert not [f for f in verify_path(d).findings if f.code.startswith("config.class")]
    if name == "qwen2_moe":
        d = _copy(built, name, tmp_path)
        _edit_tensors(d, lambda t: t.update({"model.rotary_emb.inv_freq": torch.ones(4)}))
        assert not [f for f in verify_path(d).findings if f.severity in (ERROR, WARNING)]
        _, info = _load(d)
        assert not any(info.values()), info


# -- 3. hybrid attention/SSM stacks ------------------------------------------------------------------

@pytest.mark.parametrize("name, key", [
    ("jamba", "model.layers.0.mamba.dt_proj.weight"),
    ("lfm2", "model.layers.0.conv.conv.weight"),
    ("bamba", "model.layers.0.mamba.dt_bias"),  # config.json holds {"__float__": "Infinity"}
])
def test_a_hybrid_models_ssm_tensor_is_missing(built: Built, tmp_path: Path, name: str, key: str) -> None:
    """One tensor of a Mamba (or short-conv) layer dropped. Stricter than the loader: transformers
    re-initialises it and warns (MISSING)."""
    d = _copy(built, name, tmp_path)
    _edit_tensors(d, _drop(key))
    assert _same_as_loader(d) == ({key}, set())
    _only_static_misses(d, "config.class_missing")


@pytest.mark.parametrize("name, edit", [
    ("jamba", {"attn_layer_offset": 0}),
    ("lfm2", {"layer_types": ["full_attention", "conv"]}),
], ids=["jamba-attn_layer_offset", "lfm2-layer_types"])
def test_a_hybrid_layer_kind_disagrees_with_the_weights(built: Built, tmp_path: Path, name: str,
                                                        edit: dict) -> None:
    """The config's per-layer kinds swapped: layer 0 is built as attention over stored SSM tensors
    and layer 1 the other way round. Stricter than the loader: transformers drops the stored
    tensors of both layers and re-initialises the ones the class built (UNEXPECTED, MISSING)."""
    d = _copy(built, name, tmp_path)
    _edit_config(d, **edit)
    missing, disagrees = _same_as_loader(d)
    ssm = ".mamba." if name == "jamba" else ".conv."
    for keys, first in ((missing, ".self_attn."), (disagrees, ssm)):
        assert {k for k in keys if k.startswith("model.layers.0.")} and all(
            first in k for k in keys if k.startswith("model.layers.0."))
        assert all(k.startswith(("model.layers.0.", "model.layers.1.")) for k in keys)
    _only_static_misses(d, "config.class_missing", "config.class_disagrees")


# -- 4. stacks nested in stages --------------------------------------------------------------------

@pytest.mark.parametrize("name, block", [
    ("swin", "swin.encoder.layers.0.blocks.1."),
    ("convnext", "convnext.encoder.stages.0.layers.1."),
])
def test_a_block_nested_in_a_stage_is_missing(built: Built, tmp_path: Path, name: str, block: str) -> None:
    """One block of the first stage dropped (Swin stores legacy names the loader renames: the keys
    reported are the class's, as the loader's). Stricter than the loader: it warns (MISSING)."""
    d = _copy(built, name, tmp_path)
    _edit_tensors(d, _drop(block))
    missing, _ = _same_as_loader(d)
    assert missing and all(k.startswith(block) for k in missing)
    _only_static_misses(d, "config.class_missing")


@pytest.mark.parametrize("name, depths, code, block", [
    ("swin", [1, 1], "config.class_disagrees", "swin.encoder.layers.0.blocks.1."),
    ("convnext", [1, 1], "config.class_disagrees", "convnext.encoder.stages.0.layers.1."),
    ("convnext", [2, 2], "config.class_missing", "convnext.encoder.stages.1.layers.1."),
])
def test_a_stages_depth_changed_in_the_config(built: Built, tmp_path: Path, name: str, depths: list[int],
                                              code: str, block: str) -> None:
    """config.json's depths one block short (the stored block is dropped: UNEXPECTED) or one block
    long (a block re-initialised: MISSING). Stricter than the loader, which only warns."""
    d = _copy(built, name, tmp_path)
    _edit_config(d, depths=depths)
    missing, disagrees = _same_as_loader(d)
    keys = missing if code == "config.class_missing" else disagrees
    assert keys and all(k.startswith(block) for k in keys) and not (missing and disagrees)
    _only_static_misses(d, code)


def test_disagreeing_keys_are_named_as_stored(built: Built, tmp_path: Path) -> None:
    """A finding about stored tensors names tensors the file holds (what a user greps, or drops with
    resave)."""
    d = _copy(built, "swin", tmp_path)
    _edit_config(d, depths=[1, 1])
    found = next(f for f in verify_path(d).findings if f.code == "config.class_disagrees")
    assert found.tensor in _stored(d) and set(found.details["keys"]) <= _stored(d)


# -- 5. config fields that offset which layers hold experts -----------------------------------------

@pytest.mark.parametrize("name, edit, layer", [
    ("qwen2_moe", {"mlp_only_layers": [1]}, "model.layers.1.mlp."),
    ("qwen2_moe", {"decoder_sparse_step": 2}, "model.layers.0.mlp."),
    ("jamba", {"expert_layer_offset": 0}, "model.layers."),
], ids=["qwen2_moe-mlp_only_layers", "qwen2_moe-decoder_sparse_step", "jamba-expert_layer_offset"])
def test_an_expert_layer_offset_changed_in_the_config(built: Built, tmp_path: Path, name: str, edit: dict,
                                                      layer: str) -> None:
    """Saved with experts in every layer (Qwen2-MoE) or in layer 1 (Jamba); the field that says
    which layers are sparse changed: a layer is built dense over stored experts (and Jamba's other
    way round). Stricter than the loader: it drops the experts and re-initialises a dense MLP, and
    warns (UNEXPECTED, MISSING)."""
    d = _copy(built, name, tmp_path)
    _edit_config(d, **edit)
    missing, disagrees = _same_as_loader(d)
    assert missing and disagrees and all(k.startswith(layer) for k in missing | disagrees)
    assert any(".experts." in k for k in disagrees)
    _only_static_misses(d, "config.class_missing", "config.class_disagrees")
