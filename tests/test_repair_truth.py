"""Issue 30, item 6: ``resave --repair`` tells verify's truth. A checkpoint verify fails that the
repair has nothing to fix for (an untied model without its lm_head) is not "sound": exit 1, the
errors named and said not repairable, nothing written. A healthy one still writes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import invoke, run_ckptctl


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("untied") / "m"
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(d)
    return d


def _tree(d: Path) -> list[tuple[str, int, int]]:
    return sorted((p.name, p.stat().st_ino, p.stat().st_mtime_ns) for p in d.iterdir())


def test_repair_of_a_model_without_its_lm_head_names_what_is_not_repairable(untied: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    d = Path(shutil.copytree(untied, tmp_path / "c"))
    sd = load_file(str(d / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    _, info = LlamaForCausalLM.from_pretrained(d, output_loading_info=True)
    assert "lm_head.weight" in info["missing_keys"]  # the loader initialises it at random
    r = invoke("verify", d, "--json")
    errors = [f["code"] for res in json.loads(r.stdout)["results"] for f in res["findings"] if f["severity"] == "error"]
    assert r.exit_code == 1 and errors
    before = _tree(d)
    proc = invoke("resave", "--repair", d)
    assert proc.exit_code == 1, (proc.stdout, proc.stderr)
    assert "nothing to repair" not in proc.stdout + proc.stderr and "sound" not in proc.stdout
    assert "not repairable" in proc.stderr and "lm_head.weight" in proc.stderr
    assert all(code in proc.stderr for code in errors)
    assert _tree(d) == before
    r = invoke("resave", "--repair", d, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["ok"] is False and "not repairable" in doc["error"]["message"], doc


def test_repair_of_a_healthy_checkpoint_still_writes_nothing(untied: Path, tmp_path: Path) -> None:
    d = Path(shutil.copytree(untied, tmp_path / "c"))
    before = _tree(d)
    proc = run_ckptctl("resave", "--repair", d)  # a real process: nothing imported beforehand
    assert proc.returncode == 0 and "nothing to repair" in proc.stdout, proc.stderr
    assert _tree(d) == before
