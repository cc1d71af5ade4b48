"""Broken, hostile and uncovered Megatron checkpoints: one clear error line with a hint, exit 2,
nothing published, nothing run. Each case breaks a copy of a real checkpoint
(``tests/test_megatron_build.py``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import invoke, staging_dirs
from tests.test_megatron_build import NEEDS_MEGATRON, iteration, rewrite_args, megatron_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_MEGATRON


class _Evil:
    """Pickled as a call of ``os.system``: reading the file must never run it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


_common = rewrite_args


def _missing_distcp(folder: Path, tmp: Path) -> str:
    (folder / "__1_0.distcp").unlink()
    return "__1_0.distcp is missing (needed by"


def _truncated_distcp(folder: Path, tmp: Path) -> str:
    f = folder / "__0_1.distcp"
    os.truncate(f, f.stat().st_size // 2)
    return "__0_1.distcp is truncated"


def _layernorm_model(folder: Path, tmp: Path) -> str:
    _common(folder, normalization="LayerNorm")
    return "normalization='LayerNorm' (LayerNorm: no RMSNorm-based HF family matches) is not covered"


def _layers_mismatch(folder: Path, tmp: Path) -> str:
    _common(folder, num_layers=3)
    return "stacks 2 layers; the arguments say 3"


def _a_trillion_layers(folder: Path, tmp: Path) -> str:
    _common(folder, num_layers=10**12)  # sized loops and lists before any tensor is compared
    return "num_layers is 1,000,000,000,000, more than any model has"


def _query_groups_mismatch(folder: Path, tmp: Path) -> str:
    _common(folder, num_query_groups=4)
    return "the arguments say (num_attention_heads + 2 x num_query_groups) x kv_channels = 192"


def _tied_but_head_stored(folder: Path, tmp: Path) -> str:
    _common(folder, untie_embeddings_and_output_weights=False)
    return "output_layer.weight is stored, but the arguments say the output layer is tied"


def _shared_experts(folder: Path, tmp: Path) -> str:
    _common(folder, num_experts=4, moe_shared_expert_intermediate_size=96)
    return "the DeepSeek-V3 and GLM-4.5 mappings cover the sigmoid router"


def _rotary_base_not_a_number(folder: Path, tmp: Path) -> str:
    _common(folder, rotary_base="ten thousand")
    return "argument rotary_base is 'ten thousand', not a number"


def _no_args(folder: Path, tmp: Path) -> str:
    obj = torch.load(folder / "common.pt", weights_only=False)
    obj["args"] = _Evil(tmp / "ran")  # a hostile pickle where the arguments were: never run
    torch.save(obj, folder / "common.pt")
    return "common.pt holds no Megatron-LM arguments (args)"


def _tracker_names_missing_iteration(folder: Path, tmp: Path) -> str:
    (folder.parent / "latest_checkpointed_iteration.txt").write_text("9")
    return "names iteration '9', whose folder is not in"


def _unsafe_metadata(folder: Path, tmp: Path) -> str:
    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(_Evil(tmp / "ran")))
    return "refused to unpickle"


CASES = {f.__name__[1:]: f for f in (_missing_distcp, _truncated_distcp, _layernorm_model, _layers_mismatch,
                                     _a_trillion_layers,
                                     _query_groups_mismatch, _tied_but_head_stored, _shared_experts, _rotary_base_not_a_number,
                                     _no_args,
                                     _tracker_names_missing_iteration, _unsafe_metadata)}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_megatron_checkpoint_is_refused_and_nothing_is_published(megatron_ckpts, tmp_path, case):
    src = tmp_path / "run"
    shutil.copytree(megatron_ckpts["llama_tp2"], src)
    expected = CASES[case](iteration(src), tmp_path)
    dst = tmp_path / "out"
    r = invoke("export", src, dst, "--json")
    assert r.exit_code == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert not doc["ok"] and expected in doc["error"]["message"], doc["error"]["message"]
    assert doc["error"]["hint"]
    assert not dst.exists() and staging_dirs(tmp_path) == []
    assert not (tmp_path / "ran").exists()


def test_an_uncovered_architecture_still_exports_under_megatron_names(megatron_ckpts, tmp_path):
    """What no mapping covers is refused with a hint to ``--names megatron``, which then works."""
    src = tmp_path / "run"
    shutil.copytree(megatron_ckpts["llama_tp2"], src)
    _common(iteration(src), normalization="LayerNorm")
    r = invoke("export", src, tmp_path / "out")
    assert r.exit_code == 2 and "--names megatron" in r.stderr
    r = invoke("export", src, tmp_path / "out", "--names", "megatron", "--no-fsync")
    assert r.exit_code == 0, r.stderr
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]


def test_key_and_conflicting_options_are_usage_errors(megatron_ckpts, tmp_path):
    src = megatron_ckpts["llama_tp2"]
    r = invoke("export", src, tmp_path / "a", "--key", "model")
    assert r.exit_code == 2 and "selects nothing in it" in r.stderr
    r = invoke("export", src, tmp_path / "b", "--names", "megatron", "--only", "safetensors")
    assert r.exit_code == 2 and "--names megatron reads a Megatron checkpoint" in r.stderr
    r = invoke("export", src, tmp_path / "c", "--names", "nemo")
    assert r.exit_code == 2 and "'nemo' is not one of 'hf', 'megatron'" in r.stderr  # a typed choice
    (tmp_path / "plain").mkdir()
    r = invoke("export", tmp_path / "plain", tmp_path / "d", "--only", "megatron")
    assert r.exit_code == 2 and "is not a Megatron-core torch_dist checkpoint" in r.stderr
    r = invoke("export", tmp_path / "plain", tmp_path / "e", "--only", "zero")  # the CLI takes the opener's kinds
    assert r.exit_code == 2 and "is not a DeepSpeed ZeRO checkpoint" in r.stderr
    r = invoke("export", tmp_path / "plain", tmp_path / "f", "--only", "dcp-hf")
    assert r.exit_code == 2 and "holds no DCP-HF shards" in r.stderr
    assert not any((tmp_path / n).exists() for n in "abcdef")
