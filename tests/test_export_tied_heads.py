"""Issue 14's writer defect: a pickle whose ``lm_head.weight`` shares storage with the embedding
was always written with the head dropped (recorded as an alias). That is right only when the
model ties them: with ``tie_word_embeddings: false`` in config.json, transformers then leaves the
head randomly initialised. The head is deduplicated only where the config (or the absence of
one) says tied; otherwise both are stored."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.support import run_ckptctl
from tests.support import tiny_llama as _tiny_llama

transformers = pytest.importorskip("transformers")


def _shared_head_pickle(tmp_path, tie_in_config: bool | None):
    model = _tiny_llama(tie=False, seed=3)
    sd = model.state_dict()
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # one storage, two names
    src = tmp_path / "bin"
    src.mkdir()
    torch.save(sd, src / "pytorch_model.bin")
    if tie_in_config is not None:
        model.config.tie_word_embeddings = tie_in_config
        model.config.save_pretrained(src)
        assert json.loads((src / "config.json").read_text())["tie_word_embeddings"] is tie_in_config
    return sd


def _stored(d):
    with safe_open(d / "model.safetensors", "pt") as f:
        return set(f.keys()), f.metadata()


def test_untied_config_keeps_a_head_that_shares_the_embedding_storage(tmp_path):
    sd = _shared_head_pickle(tmp_path, tie_in_config=False)
    run_ckptctl("export", str(tmp_path / "bin"), str(tmp_path / "out"), check=True)
    keys, meta = _stored(tmp_path / "out")
    assert keys == set(sd)
    assert meta == {"format": "pt"}  # no alias record: the head is a tensor of its own
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.config.tie_word_embeddings is False
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    for k, v in sd.items():
        assert torch.equal(loaded.state_dict()[k], v), k  # the head is the stored one, not a random init
    run_ckptctl("verify", str(tmp_path / "out"), check=True)


@pytest.mark.parametrize("tie_in_config", [True, None])
def test_tied_or_absent_config_stores_the_head_once(tmp_path, tie_in_config):
    sd = _shared_head_pickle(tmp_path, tie_in_config=tie_in_config)
    run_ckptctl("export", str(tmp_path / "bin"), str(tmp_path / "out"), check=True)
    keys, meta = _stored(tmp_path / "out")
    assert keys == set(sd) - {"lm_head.weight"}
    assert meta == {"format": "pt", "lm_head.weight": "model.embed_tokens.weight"}
    if tie_in_config:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        for k, v in sd.items():
            assert torch.equal(loaded.state_dict()[k], v), k
