"""Every broken checkpoint of the corpus gives its documented code and exit code; clean ones pass."""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import corpus
from ckptctl.cli.verify_cmd import verify

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "VERIFY_CODES.md"


def documented() -> dict[str, set[str]]:
    """code -> allowed severities, parsed from the tables of docs/VERIFY_CODES.md."""
    out: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| ([a-z, ]+) \|", line)
        if m:
            out[m.group(1)] = {s.strip() for s in m.group(2).split(",")}
    return out


DOCUMENTED = documented()


def app() -> typer.Typer:
    a = typer.Typer()
    a.command("verify")(verify)
    return a


def run(*args: object) -> tuple[int, dict]:
    res = CliRunner().invoke(app(), [str(a) for a in args] + ["--json"])
    assert res.stdout.strip(), res.stderr
    return res.exit_code, json.loads(res.stdout)


def codes(doc: dict) -> dict[str, str]:
    return {f["code"]: f["severity"] for r in doc["results"] for f in r["findings"]}


@pytest.mark.parametrize("case", corpus.CASES, ids=str)
def test_broken_checkpoint_gives_its_code(case: corpus.Case, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    expected = case.make(d)
    assert expected in DOCUMENTED, f"{expected} is not documented in {DOC.name}"
    rc, doc = run(d, *case.args)
    found = codes(doc)
    assert expected in found, f"{case.name}: expected {expected}, got {sorted(found)}"
    assert doc["schema_version"] == 1 and doc["command"] == "verify"
    assert found[expected] in DOCUMENTED[expected]
    if found[expected] == "error":
        assert rc == 1 and doc["ok"] is False
        return
    assert rc == 0 and doc["ok"] is True, f"{case.name}: a {found[expected]} case must not also have errors: {found}"
    rc_w, doc_w = run(d, *case.args, "--fail-on", "warning")
    if found[expected] == "warning":
        assert rc_w == 1 and doc_w["ok"] is False
    else:  # info never fails a run
        assert found[expected] == "info" and "warning" not in found.values() and rc_w == 0


def test_deep_only_cases_are_invisible_without_deep(tmp_path: Path) -> None:
    """A same-size corruption needs --deep: without it the checkpoint looks clean."""
    for case in [c for c in corpus.CASES if c.deep]:
        d = tmp_path / case.name
        code = case.make(d)
        rc, doc = run(d, *[a for a in case.args if a != "--deep"])
        assert code not in codes(doc) and rc == 0, case.name


@pytest.mark.parametrize("name", sorted(corpus.CLEAN))
def test_clean_corpus_checkpoints_pass(name: str, tmp_path: Path) -> None:
    d = tmp_path / name
    corpus.CLEAN[name](d)
    rc, doc = run(d, "--deep", "--fail-on", "warning")
    bad = [(f["code"], f["message"]) for r in doc["results"] for f in r["findings"] if f["severity"] != "info"]
    assert rc == 0 and not bad, bad
    assert doc["results"][0]["bytes_read"] > 0


def test_every_code_the_code_can_emit_is_documented() -> None:
    pat = re.compile(r'"((?:header|index|layout|dir|config|adapter|manifest|pickle|dcp|deep|metadata|io|zero|megatron)'
                     r'\.[a-z_0-9]+)"')
    sources = sorted((REPO / "ckptctl" / "verify").rglob("*.py"))  # with verify/classes/
    sources += sorted((REPO / "ckptctl" / "layout").glob("*.py")) + [REPO / "ckptctl" / "manifest.py"]
    sources += [REPO / "ckptctl" / "format" / n for n in ("header.py", "header_rules.py", "index.py", "dcp_metadata.py")]
    emitted = {m for p in sources for m in pat.findall(p.read_text())} - {"config.json"}
    assert {"dir.lock_file", "layout.leftover", "dcp.bad_metadata", "index.wrong_shard"} <= emitted  # it sees them
    assert not sorted(emitted - set(DOCUMENTED)), f"undocumented codes: {sorted(emitted - set(DOCUMENTED))}"
    assert not sorted(set(DOCUMENTED) - emitted), f"documented but never emitted: {sorted(set(DOCUMENTED) - emitted)}"


def _returned_code(fn: object) -> str:
    """The code a builder returns: the string constant its last statement returns."""
    last = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body[-1]
    assert isinstance(last, ast.Return) and isinstance(last.value, ast.Constant), fn
    return last.value.value


# Codes verify cannot be made to report on a checkpoint, each asserted by the test named here:
ASSERTED_ELSEWHERE = {
    "zero.checkpoint": ("test_zero_inspect.py", "test_verify_reports_the_zero_checkpoint_and_passes"),
    "config.class_refused": ("test_verify_quantized.py", "test_a_weight_block_size_transformers_refuses"),
    "config.st_activation": ("test_verify_class_box.py", "test_the_issues_hostile_configs_through_the_cli"),
    "zero.damaged": ("test_zero_hostile.py", "test_broken_zero_checkpoint_is_refused_and_nothing_is_published"),
    "megatron.checkpoint": ("test_source_kinds.py", "test_export_inspect_and_verify_choose_megatron_for_each_megatron_fixture"),
    "megatron.not_mapped": ("test_source_kinds.py",
                            "test_verify_of_a_megatron_checkpoint_no_mapping_covers_passes_with_a_note"),
    "megatron.damaged": ("test_source_kinds.py", "test_verify_of_a_damaged_megatron_checkpoint_fails_naming_it"),
    "megatron.args_disagree": ("test_megatron_verify.py",
                               "test_arguments_contradicting_a_tensor_fail_verify_naming_the_argument"),
    "megatron.vocab_padded": ("test_megatron_verify.py", "test_a_sound_checkpoint_verifies_and_inspect_shows_its_layout"),
    "deep.zip_crc_mismatch": ("test_verify_deep.py", "test_deep_checks_the_crc32_of_every_record_of_a_bin"),
    # root reads every file it can stat, so the one real read error is /proc/self/mem given as a
    # file (inside a directory it is a link that leaves the checkpoint); exit 3, not 1
    "io.error": ("test_verify_cli.py", "test_io_error_exits_three_even_with_other_findings"),
    # verify's screening reports a FIFO, directory or dangling link under the index's name first
    # (dir.not_a_file / dir.broken_link) and layout never sees it; layout's own test does
    "layout.unsafe_index": ("test_layout.py", "test_fifo_index_is_reported_and_never_opened"),
    # the same screening (and the regular-file check before a read) comes before the header reader
    # in verify; inspect and export read the header directly
    "header.not_a_file": ("test_export.py", "test_fifo_where_a_shard_should_be_is_refused_without_hanging"),
    # built by breaking real library outputs (tests/ecosystem), not the corpus's numpy builders
    "config.expert_missing": ("test_verify_ecosystem.py", "test_moe_expert_missing"),
    "config.expert_count": ("test_verify_ecosystem.py", "test_moe_expert_count_disagrees_with_config"),
    "config.lm_head_tied_differs": ("test_verify_ecosystem.py", "test_tied_config_with_a_different_stored_lm_head"),
    "deep.blob_hash_mismatch": ("test_verify_ecosystem.py", "test_hf_cache_blob_hash_and_dangling_link"),
    "dir.file_too_large_for_hub": ("test_verify_ecosystem.py", "test_file_over_the_hub_limit"),
    # issue 30, items 4 and 5, and issue 31: built from real library outputs (transformers, torch DCP,
    # sentence-transformers), each judged by the library's own loader in the same test
    "layout.native_weights": ("test_verify_consistency.py", "test_mistral_native_files_beside_hf_shards_are_clean"),
    "layout.converted_pickle": ("test_verify_consistency.py",
                                "test_bin_beside_safetensors_with_the_same_tensors_is_a_note"),
    "deep.pickle_copy_differs": ("test_verify_consistency.py",
                                 "test_bin_beside_safetensors_with_the_same_tensors_is_a_note"),
    "dcp.hf_sharded": ("test_verify_consistency.py", "test_dcp_hf_output_is_recognised"),
    "dcp.hf_damaged": ("test_verify_consistency.py", "test_dcp_hf_output_is_recognised"),
    "dir.leftover_weights_folder": ("test_verify_consistency.py", "test_dcp_hf_output_is_recognised"),
    "config.generation_config_bad": ("test_verify_consistency.py", "test_generation_config_that_does_not_parse"),
    "config.generation_token_id": ("test_verify_consistency.py", "test_generation_token_ids_outside_the_vocabulary"),
    "config.tokenizer_added_id": ("test_verify_consistency.py", "test_added_tokens_outside_the_vocabulary"),
    "dir.trainer_state_without_weights": ("test_verify_consistency.py",
                                          "test_trainer_checkpoint_without_model_weights"),
    "dir.placeholder_tensors": ("test_verify_consistency.py", "test_zero3_placeholders"),
    "config.pipeline_mismatch": ("test_verify_pipeline_components.py",
                                 "test_a_text_encoder_of_another_width_is_a_pipeline_mismatch"),
    "config.preprocessor_mismatch": ("test_verify_preprocessor.py",
                                     "test_a_processor_of_another_image_size_is_a_preprocessor_mismatch"),
    "config.quant_packing_mismatch": ("test_verify_quantized_packing.py",
                                      "test_bits_or_group_size_edited_is_a_packing_mismatch_the_library_fails_on"),
    "config.quant_g_idx_missing": ("test_verify_quantized_packing.py",
                                   "test_a_gptq_file_without_g_idx_is_an_error_the_library_breaks_on"),
    "config.quant_packing_not_checked": ("test_verify_quantized_packing.py",
                                         "test_a_packing_the_check_does_not_know_is_said_not_an_error"),
    "deep.dtype_overflow": ("test_verify_deep_values.py", "test_values_a_float16_config_turns_into_inf_are_found_by_deep"),
    "deep.zero_tail": ("test_verify_deep_values.py", "test_a_shard_whose_tail_is_zeros_is_found_by_deep"),
    "config.dtype_lossy": ("test_verify_consistency.py", "test_half_precision_weights_declared_in_the_other_half_are_lossy"),
    "config.st_dimension_mismatch": ("test_verify_consistency.py",
                                     "test_sentence_transformers_dimensions_that_disagree"),
}


def test_every_documented_code_is_asserted_by_a_test() -> None:
    """One builder per code (its returned code is asserted above), or a named test that asserts it."""
    built = {_returned_code(c.make) for c in corpus.CASES}
    assert len(corpus.CASES) >= 120 and built <= set(DOCUMENTED)
    for code, (module, test) in ASSERTED_ELSEWHERE.items():
        tree = ast.parse((REPO / "tests" / module).read_text())
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == test), None)
        assert fn is not None, f"{module}::{test} does not exist"
        asserted = {c.value for a in ast.walk(fn) if isinstance(a, ast.Assert)
                    for c in ast.walk(a) if isinstance(c, ast.Constant)}
        assert code in asserted, f"{module}::{test} does not assert {code}"
    assert not built & set(ASSERTED_ELSEWHERE), "a code with a builder needs no other test here"
    assert set(DOCUMENTED) - built - set(ASSERTED_ELSEWHERE) == set()


def test_corpus_base_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    """The corpus base is a real Llama checkpoint, not a look-alike: transformers loads it strictly."""
    import torch
    from transformers import LlamaForCausalLM

    d = tmp_path / "base"
    corpus.make_clean_sharded(d)
    model, info = LlamaForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)
