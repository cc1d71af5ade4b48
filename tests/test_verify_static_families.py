"""verify's static rules on families whose layout they do not know (issue 45): clean checkpoints
written by transformers itself (MiniMax's fused linear-attention qkv_proj, Mllama's vision tower and
its embedding larger than vocab_size by design, DETR's ResNet backbone, SpeechT5's pre-nets and
wrapped stacks) give no error in either mode, and each loads strictly in its own library. A rule
that does not know the layout says so with a config.not_checked note; the rules still catch
damage in the stacks they do know."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.support.cli import invoke

T = pytest.importorskip("transformers")


def _minimax() -> Any:
    return T.MiniMaxForCausalLM(T.MiniMaxConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"], block_size=16))


def _mllama() -> Any:
    tc = T.MllamaTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vc = T.MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                              attention_heads=4, image_size=32, patch_size=8, intermediate_layers_indices=[0],
                              vision_output_dim=64, max_num_tiles=4)
    return T.MllamaForConditionalGeneration(T.MllamaConfig(text_config=tc.to_dict(), vision_config=vc.to_dict()))


def _detr() -> Any:
    backbone = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1])
    return T.DetrForObjectDetection(T.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone.to_dict(), d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5))


def _speecht5(cls: str) -> Callable[[], Any]:
    def make() -> Any:
        return getattr(T, cls)(T.SpeechT5Config(
            vocab_size=32, hidden_size=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, speech_decoder_prenet_units=16,
            speech_decoder_postnet_units=16, speech_decoder_postnet_layers=2, num_mel_bins=8, conv_dim=[8, 8],
            conv_stride=[2, 2], conv_kernel=[3, 3], num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
            speaker_embedding_dim=16))
    return make


FAMILIES: dict[str, Callable[[], Any]] = {
    "minimax": _minimax, "mllama": _mllama, "detr": _detr,
    "speecht5_tts": _speecht5("SpeechT5ForTextToSpeech"), "speecht5_asr": _speecht5("SpeechT5ForSpeechToText"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    out = {}
    root = tmp_path_factory.mktemp("families")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, make in FAMILIES.items():
            torch.manual_seed(0)
            model = make()
            model.save_pretrained(root / name)
            out[name] = root / name
    return out


def _findings(path: Path, *args: str) -> tuple[int, list[dict]]:
    r = invoke("verify", path, "--json", *args)
    doc = json.loads(r.stdout)
    return r.exit_code, [f for res in doc["results"] for f in res["findings"]]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_clean_checkpoint_of_a_family_the_rules_do_not_know_passes_in_both_modes(saved, name):
    cls = type(FAMILIES[name]())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = cls.from_pretrained(saved[name], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for args in (("--static",), ()):
        rc, found = _findings(saved[name], *args)
        errors = [(f["code"], f["message"]) for f in found if f["severity"] == "error"]
        assert rc == 0 and errors == [], (args, errors)
    rc, found = _findings(saved[name], "--static")
    assert any(f["code"] == "config.not_checked" for f in found)  # what it did not understand is said


def test_the_known_stacks_of_such_a_family_are_still_counted(saved, tmp_path):
    """DETR: its encoder stack against encoder_layers, in --static, while the backbone's stages are
    only named in a note."""
    import shutil

    d = Path(shutil.copytree(saved["detr"], tmp_path / "detr"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["encoder_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    rc, found = _findings(d, "--static")
    missing = [f for f in found if f["code"] == "config.layer_missing"]
    assert rc == 1 and len(missing) == 1 and "model.encoder.layers" in missing[0]["message"], missing
    assert any(f["code"] == "config.not_checked" and "backbone" in f["message"] for f in found)
