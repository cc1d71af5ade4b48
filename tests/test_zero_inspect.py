"""inspect and verify of a DeepSpeed ZeRO checkpoint (issue 31): stage, world size, the
parameters DeepSpeed would reconstruct (names, shapes, count), the rank files; without torch."""

from __future__ import annotations

import json
import math

import pytest

from tests.support import invoke
from tests.test_layering import probe
from tests.test_zero_build import NEEDS_DEEPSPEED, ckpt, step, zero_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_DEEPSPEED


def _oracle_specs(root) -> dict[str, tuple[str, list[int]]]:
    from safetensors import safe_open

    with safe_open(str(root / "oracle.safetensors"), "np") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("name,stage", [("s1_fp32", 1), ("s2_frozen", 2), ("s3_bf16", 3)])
def test_inspect_shows_stage_world_size_and_the_reconstructed_parameters(zero_ckpts, name, stage):
    root = zero_ckpts[name]
    want = _oracle_specs(root)
    for path, prefix in ((ckpt(root), "global_step3/"), (step(root), "")):
        r = invoke("inspect", path, "--json", "--tensors")
        assert r.exit_code == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["format"] == f"deepspeed-zero{stage}"
        assert doc["zero"] == {"stage": stage, "world_size": 2, "tag": "global_step3", "ds_version": doc["zero"]["ds_version"]}
        aliases = doc.get("aliases", {})
        got = {t["name"]: (t["dtype"], t["shape"]) for t in doc["tensors"]}
        assert set(got) | set(aliases) == set(want) and not set(got) & set(aliases)
        assert all(got[k] == want[k] for k in got)
        assert doc["parameters"] == sum(math.prod(s) for k, (_, s) in want.items() if k not in aliases)
        rank_files = sorted(f["name"] for f in doc["files"] if f["role"] == "optimizer-states")
        bf16 = "bf16_" if name.endswith("bf16") else ""
        assert rank_files == [f"{prefix}{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
        assert {f["name"].rsplit("/", 1)[-1] for f in doc["files"] if f["role"] == "extra"} == \
            {"config.json", "tokenizer_config.json"}


def test_verify_reports_the_zero_checkpoint_and_passes(zero_ckpts):
    for path in (ckpt(zero_ckpts["s3_fp32"]), step(zero_ckpts["s3_fp32"])):
        r = invoke("verify", path, "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        found = [f for res in json.loads(r.stdout)["results"] for f in res["findings"] if f["code"] == "zero.checkpoint"]
        assert len(found) == 1 and found[0]["severity"] == "info" and found[0]["code"] == "zero.checkpoint"
        assert "stage 3" in found[0]["message"] and "of 2 ranks" in found[0]["message"]


def test_inspect_of_a_zero_checkpoint_imports_no_torch(zero_ckpts):
    result, out = probe(["inspect", ckpt(zero_ckpts["s2_bf16"]), "--json"])
    assert result == {"exit": 0, "heavy": []} and json.loads(out)["zero"]["stage"] == 2
