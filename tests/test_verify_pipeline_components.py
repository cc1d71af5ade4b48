"""A diffusers pipeline whose components disagree (issue 45): each component is self-consistent
and DiffusionPipeline.from_pretrained loads the root without a word, but the first generation
fails. verify reports config.pipeline_mismatch (an error) where the pipeline's own first use
fails, and nothing on the pipeline diffusers saved."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from tests.ecosystem.diffusers_models import load_pipeline, make_pipeline, make_vae, run_pipeline
from tests.ecosystem.transformers_models import transformers_module
from tests.support.cli import invoke

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sd") / "pipe"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_pipeline().save_pretrained(d)
    return d


def _verify(d: Path, *args: str) -> tuple[int, list[dict]]:
    r = invoke("verify", d, "--json", *args)
    doc = json.loads(r.stdout)
    return r.exit_code, [f for res in doc["results"] for f in res["findings"]]


def _first_use_fails(d: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = load_pipeline(d)  # loads: every component alone is sound
        with pytest.raises(RuntimeError):  # a shape error at the first generation
            run_pipeline(pipe)


def test_the_pipeline_diffusers_saved_passes(pipeline):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_pipeline(load_pipeline(pipeline))
    for args in ((), ("--static",)):
        rc, found = _verify(pipeline, *args)
        assert rc == 0 and not [f for f in found if f["severity"] == "error"], found
        assert "config.pipeline_mismatch" not in {f["code"] for f in found}


def test_a_text_encoder_of_another_width_is_a_pipeline_mismatch(pipeline, tmp_path):
    d = Path(shutil.copytree(pipeline, tmp_path / "pipe"))
    t = transformers_module()
    shutil.rmtree(d / "text_encoder")
    t.CLIPTextModel(t.CLIPTextConfig(vocab_size=96, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=16, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)).save_pretrained(d / "text_encoder")
    _first_use_fails(d)
    for args in ((), ("--static",)):
        rc, found = _verify(d, *args)
        bad = [f for f in found if f["code"] == "config.pipeline_mismatch"]
        assert rc == 1 and len(bad) == 1 and bad[0]["severity"] == "error", found
        assert bad[0]["code"] == "config.pipeline_mismatch" and bad[0]["details"]["field"] == "cross_attention_dim"
        assert bad[0]["details"]["actual"] == 24


def test_a_vae_of_another_latent_width_is_a_pipeline_mismatch(pipeline, tmp_path):
    d = Path(shutil.copytree(pipeline, tmp_path / "pipe"))
    shutil.rmtree(d / "vae")
    vae = make_vae(1)
    cfg = dict(vae.config)
    cfg["latent_channels"] = 8
    type(vae).from_config(cfg).save_pretrained(d / "vae")
    _first_use_fails(d)
    rc, found = _verify(d, "--static")
    bad = [f for f in found if f["code"] == "config.pipeline_mismatch"]
    assert rc == 1 and len(bad) == 1 and bad[0]["details"]["field"] == "out_channels", found
