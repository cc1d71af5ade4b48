"""An image processor that disagrees with the vision tower it feeds (issue 45): CLIP's model and a
processor that crops 48 x 48 for a 32 x 32 tower each load, and the first image fails; verify
reports config.preprocessor_mismatch (an error). The processor that matches passes."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

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
