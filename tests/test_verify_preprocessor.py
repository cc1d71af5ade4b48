"""An image processor that disagrees with the vision tower it feeds (issue 45): CLIP's model and a
processor that crops 48 x 48 for a 32 x 32 tower each load, and the first image fails; a PaliGemma
or Gemma3 processor whose image_seq_length, or a LlavaProcessor whose patch_size (or CLS count,
or feature strategy), makes another number of image tokens than the tower's features loads, and the first image
fails (``Image features and image tokens do not match``). verify reports config.preprocessor_mismatch
(an error) in both modes. The processor saved with the model passes."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from ecosystem.transformers_models import tiny_tokenizer

from tests.support.cli import invoke

T = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("clip") / "clip"
    cfg = T.CLIPConfig(text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=16, bos_token_id=0,
                                        eos_token_id=1, pad_token_id=1),
                       vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=32, patch_size=8), projection_dim=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.CLIPModel(cfg).save_pretrained(d)
        T.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(d)
    return d


def _features(d: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pixels = T.AutoImageProcessor.from_pretrained(d)(images=np.zeros((40, 40, 3), np.uint8),
                                                         return_tensors="pt").pixel_values
        return T.CLIPModel.from_pretrained(d).get_image_features(pixel_values=pixels)


def _codes(d: Path, *args: str) -> tuple[int, dict[str, str]]:
    r = invoke("verify", d, "--json", *args)
    doc = json.loads(r.stdout)
    return r.exit_code, {f["code"]: f["severity"] for res in doc["results"] for f in res["findings"]}


def test_the_processor_saved_with_the_model_passes(clip):
    assert _features(clip) is not None
    for args in ((), ("--static",)):
        rc, found = _codes(clip, *args)
        assert rc == 0 and "config.preprocessor_mismatch" not in found, found


def test_a_processor_of_another_image_size_is_a_preprocessor_mismatch(clip, tmp_path):
    d = Path(shutil.copytree(clip, tmp_path / "clip"))
    T.CLIPImageProcessor(size={"shortest_edge": 48}, crop_size={"height": 48, "width": 48}).save_pretrained(d)
    with pytest.raises(ValueError, match="doesn't match model"):
        _features(d)
    for args in ((), ("--static",)):
        rc, found = _codes(d, *args)
        assert rc == 1 and found.get("config.preprocessor_mismatch") == "error", found


def _edit(src: Path, dst: Path, name: str, path: tuple[str, ...], value: object) -> Path:
    d = Path(shutil.copytree(src, dst))
    doc = json.loads((d / name).read_text())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (d / name).write_text(json.dumps(doc))
    return d


def _first_image(d: Path) -> None:
    """The processor's text and pixels for one image, through the model (raises where they disagree)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proc = T.AutoProcessor.from_pretrained(d)
        model = T.AutoModelForImageTextToText.from_pretrained(d)
        text = "<start_of_image> w1 w2" if type(proc).__name__ == "Gemma3Processor" else "<image>w1 w2"
        inputs = proc(text=text, images=np.zeros((40, 40, 3), np.uint8), return_tensors="pt")
        assert model(**inputs).logits.isfinite().all()


VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("paligemma") / "paligemma"
    tok = tiny_tokenizer()
    cfg = T.PaliGemmaConfig(vision_config=dict(model_type="siglip_vision_model", **VISION),
                            text_config=dict(model_type="gemma", vocab_size=1300, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             head_dim=8),
                            projection_dim=16, image_token_index=len(tok))  # where the processor adds <image>
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.PaliGemmaForConditionalGeneration(cfg).save_pretrained(d)
        T.PaliGemmaProcessor(image_processor=T.SiglipImageProcessor(size={"height": 32, "width": 32},
                                                                    image_seq_length=16),
                             tokenizer=tok).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llava") / "llava"
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    cfg = T.LlavaConfig(vision_config=dict(model_type="clip_vision_model", projection_dim=16, **VISION),
                        text_config=dict(model_type="llama", vocab_size=80, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.LlavaForConditionalGeneration(cfg).save_pretrained(d)
        T.LlavaProcessor(image_processor=T.CLIPImageProcessor(size={"shortest_edge": 32},
                                                              crop_size={"height": 32, "width": 32}),
                         tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                         num_additional_image_tokens=1).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gemma3") / "gemma3"
    words = tiny_tokenizer(model_max_length=512)
    special = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    words.add_special_tokens({"additional_special_tokens": list(special.values())})
    tok = T.PreTrainedTokenizerFast(tokenizer_object=words.backend_tokenizer, pad_token="<pad>", bos_token="<s>",
                                    eos_token="</s>", unk_token="<unk>", model_max_length=512,
                                    extra_special_tokens=special)
    text = dict(model_type="gemma3_text", vocab_size=80, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    cfg = T.Gemma3Config(vision_config=dict(model_type="siglip_vision_model", **VISION), text_config=text,
                         mm_tokens_per_image=4, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
                         eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.Gemma3ForConditionalGeneration(cfg).save_pretrained(d)
        T.Gemma3Processor(image_processor=T.Gemma3ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok,
                          image_seq_length=4).save_pretrained(d)
    return d


def test_the_vision_language_processors_saved_with_their_models_pass(paligemma, llava, gemma3):
    for d in (paligemma, llava, gemma3):
        _first_image(d)
        for args in ((), ("--static",)):
            rc, found = _codes(d, *args)
            assert rc == 0 and "config.preprocessor_mismatch" not in found, (d, found)


@pytest.mark.parametrize("model, path, value", [
    ("paligemma", ("image_processor", "image_seq_length"), 12),
    ("paligemma", ("image_processor", "image_seq_length"), 64),
    ("llava", ("patch_size",), 16),
    ("llava", ("patch_size",), 4),
    ("llava", ("num_additional_image_tokens",), 0),
    ("llava", ("vision_feature_select_strategy",), "full"),
    ("gemma3", ("image_seq_length",), 16),
    ("gemma3", ("image_seq_length",), 1),
])
def test_a_processor_that_makes_another_number_of_image_tokens_is_a_preprocessor_mismatch(
        request, tmp_path, model, path, value):
    d = _edit(request.getfixturevalue(model), tmp_path / model, "processor_config.json", path, value)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        _first_image(d)
    for args in ((), ("--static",)):
        rc, found = _codes(d, *args)
        assert rc == 1 and found.get("config.preprocessor_mismatch") == "error", (path, value, found)



def test_a_gemma3_config_that_pools_to_another_number_of_tokens_is_a_preprocessor_mismatch(gemma3, tmp_path):
    # the processor is the one saved; config.json's mm_tokens_per_image makes the projector pool the
    # 4 x 4 patches to 16 features instead of 4
    d = _edit(gemma3, tmp_path / "gemma3", "config.json", ("mm_tokens_per_image",), 16)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        _first_image(d)
    rc, found = _codes(d)
    assert rc == 1 and found.get("config.preprocessor_mismatch") == "error", found


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("siglip2") / "siglip2"
    cfg = T.Siglip2Config(text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, max_position_embeddings=16),
                          vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, patch_size=8, num_patches=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.Siglip2Model(cfg).save_pretrained(d)
        T.Siglip2ImageProcessor(patch_size=8, max_num_patches=16).save_pretrained(d)
    return d


def _siglip2_features(d: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = T.AutoImageProcessor.from_pretrained(d)(images=np.zeros((40, 40, 3), np.uint8), return_tensors="pt")
        return T.Siglip2Model.from_pretrained(d).get_image_features(**inputs)


@pytest.mark.parametrize("patch", [16, 4])
def test_a_siglip2_processor_that_cuts_other_patches_is_a_preprocessor_mismatch(siglip2, tmp_path, patch):
    d = _edit(siglip2, tmp_path / "siglip2", "preprocessor_config.json", ("patch_size",), patch)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        _siglip2_features(d)
    for args in ((), ("--static",)):
        rc, found = _codes(d, *args)
        assert rc == 1 and found.get("config.preprocessor_mismatch") == "error", (patch, found)


def test_a_siglip2_processor_saved_with_the_model_or_with_more_patches_passes(siglip2, tmp_path):
    # max_num_patches is the processor's budget: the tower interpolates its position embeddings
    more = _edit(siglip2, tmp_path / "siglip2", "preprocessor_config.json", ("max_num_patches",), 64)
    for d in (siglip2, more):
        assert _siglip2_features(d) is not None
        for args in ((), ("--static",)):
            rc, found = _codes(d, *args)
            assert rc == 0 and "config.preprocessor_mismatch" not in found, (d, found)
