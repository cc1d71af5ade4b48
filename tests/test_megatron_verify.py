"""verify and inspect of the newer Megatron families (issue 43): a sound checkpoint exits 0 and
lists what was checked (keys stacked or per layer, MTP layers, the mapping); arguments that
contradict a tensor are an error naming the argument; a checkpoint without arguments is a note."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support import invoke
from tests.test_megatron_build import NEEDS_MEGATRON, iteration
from tests.test_megatron_families import _common
from tests.test_megatron_families_build import family_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_MEGATRON
LAYOUT = {"qwen3_tp2": ("qwen3", "stacked", 0), "qwen3_moe_grouped_ep2": ("qwen3_moe", "stacked", 0),
          "deepseek_tp2ep2": ("deepseek_v3", "per-layer", 0), "glm_ep2_mtp": ("glm4_moe", "per-layer", 1)}


def _findings(path) -> tuple[int, dict[str, dict]]:
    r = invoke("verify", path, "--json")
    doc = json.loads(r.stdout)
    return r.exit_code, {f["code"]: f for res in doc.get("results", [doc]) for f in res.get("findings", [])}


@pytest.mark.parametrize("name", list(LAYOUT))
def test_a_sound_checkpoint_verifies_and_inspect_shows_its_layout(family_ckpts, name):
    mapping, keys, mtp = LAYOUT[name]
    code, found = _findings(family_ckpts[name])
    assert code == 0, found
    ck = found["megatron.checkpoint"]
    assert ck["severity"] == "info" and f"{keys} layer keys, {mtp} MTP layers" in ck["message"]
    assert "the arguments agreeing with every tensor" in ck["message"] and f"mapping: {mapping}" in ck["message"]
    assert ("megatron.vocab_padded" in found) == (name == "qwen3_moe_grouped_ep2")
    r = invoke("inspect", family_ckpts[name], "--json")
    mega = json.loads(r.stdout)["megatron"]
    assert (mega["mapping"], mega["keys"], mega["mtp_layers"]) == (mapping, keys, mtp)


@pytest.mark.parametrize("name,changes,message", [
    ("qwen3_tp2", dict(hidden_size=128), "the arguments say hidden_size = 128"),
    ("deepseek_tp2ep2", dict(q_lora_rank=16), "the arguments say q_lora_rank = 16"),
    ("glm_ep2_mtp", dict(num_layers=3, moe_layer_freq=[0, 1, 1]), "layer 2 (decoder.layers.2.*) is missing; the arguments say 3 layers"),
])
def test_arguments_contradicting_a_tensor_fail_verify_naming_the_argument(family_ckpts, tmp_path, name, changes,
                                                                          message):
    run = tmp_path / "run"
    shutil.copytree(family_ckpts[name], run)
    _common(iteration(run), **changes)
    code, found = _findings(run)
    assert code != 0 and found["megatron.args_disagree"]["severity"] == "error", found
    assert message in found["megatron.args_disagree"]["message"]
    assert "megatron.not_mapped" not in found


def test_a_checkpoint_without_arguments_verifies_with_a_note(family_ckpts, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(family_ckpts["qwen3_tp2"], run)
    (iteration(run) / "common.pt").unlink()
    code, found = _findings(run)
    assert code == 0, found
    assert "there is no common.pt" in found["megatron.not_mapped"]["message"]
    assert "--config CONFIG_JSON" in found["megatron.not_mapped"]["hint"]
