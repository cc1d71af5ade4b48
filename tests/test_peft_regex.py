"""Issue 44: a regex from adapter_config.json is never run unbounded. ``(.|.)*z`` (alternation
under repetition) passed the nested-quantifier guard and hung ``verify --static`` for minutes per
module name; now every pattern is read from ``re``'s own parse first, and one that repeats a
quantifier or an alternation (or has too many unbounded repeats) is not run: an
``adapter.regex_not_checked`` note, verify exits 0."""

from __future__ import annotations

import json

import pytest

from tests.corpus import adapter_config, base_for, llama_lora_modules, lora_tensors, write_adapter
from tests.support.cli import run_ckptctl

HOSTILE = {
    "alternation under repetition": (r"(.|.)*z", "repeats an alternation"),
    "nested quantifiers": (r"(\w+\.?\w*)+X", "nests quantifiers"),
    "overlapping alternatives": (r"(a|ab)*c", "repeats an alternation"),
    "many unbounded repeats": (r".*a.*b.*c.*d.*e", "more than 4 unbounded repeats"),
}
SAFE = [r".*\.(q_proj|v_proj)$", r"model\.layers\.\d+\.self_attn\.(q|v)_proj", "all-linear", r"[\w.]*\.q_proj"]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_target_modules_regex_is_a_note_and_verify_finishes(tmp_path, case):
    pattern, why = HOSTILE[case]
    d = tmp_path / "adapter"
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d), target_modules=pattern))
    r = run_ckptctl("verify", "--static", d, "--json", timeout=600)  # minutes per module name before
    assert r.returncode == 0, r.stderr[-2000:]
    findings = json.loads(r.stdout)["results"][0]["findings"]
    (found,) = [f for f in findings if f["code"] == "adapter.regex_not_checked"]
    assert found["severity"] == "info" and why in found["message"] and repr(pattern) in found["message"], found


@pytest.mark.parametrize("pattern", SAFE)
def test_patterns_peft_users_write_are_still_run(pattern):
    from ckptctl.verify.peft import _backtracking_risk, peft_target_match

    assert _backtracking_risk(pattern) is None
    assert peft_target_match({"target_modules": pattern}, "model.layers.0.self_attn.q_proj")


def test_the_rank_pattern_a_pattern_is_wrapped_in_is_checked_too():
    from ckptctl.verify.peft import _backtracking_risk, _user_patterns

    patterns = _user_patterns({"rank_pattern": {"(xa|yb)+z": 8}, "layers_pattern": "layers"})
    assert [bool(_backtracking_risk(p)) for p in patterns] == [False, True]
