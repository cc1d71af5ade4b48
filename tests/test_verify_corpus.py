"""Every broken checkpoint of the corpus gives its documented code and exit code; clean ones pass."""

from __future__ import annotations

import json
import re
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
    severity = next(iter(DOCUMENTED[expected])) if len(DOCUMENTED[expected]) == 1 else None
    deep = ["--deep"] if case.deep else []
    rc, doc = run(d, *deep)
    found = codes(doc)
    assert expected in found, f"{case.name}: expected {expected}, got {sorted(found)}"
    assert doc["schema_version"] == 1 and doc["command"] == "verify"
    assert found[expected] in DOCUMENTED[expected]
    if (severity or found[expected]) == "error":
        assert rc == 1 and doc["ok"] is False
    else:
        assert found[expected] == "warning"
        assert rc == 0 and doc["ok"] is True, f"{case.name}: a warning case must not also have errors: {found}"
        rc_w, doc_w = run(d, *deep, "--fail-on", "warning")
        assert rc_w == 1 and doc_w["ok"] is False


def test_deep_only_cases_are_invisible_without_deep(tmp_path: Path) -> None:
    """A same-size corruption needs --deep: without it the checkpoint looks clean."""
    for case in [c for c in corpus.CASES if c.deep]:
        d = tmp_path / case.name
        code = case.make(d)
        rc, doc = run(d)
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
    pat = re.compile(r'"((?:header|index|layout|dir|config|adapter|manifest|pickle|dcp|deep|metadata|io)'
                     r'\.[a-z_0-9]+)"')
    sources = sorted((REPO / "ckptctl" / "verify").glob("*.py"))
    sources += [REPO / "ckptctl" / n for n in ("layout.py", "manifest.py")]
    sources += [REPO / "ckptctl" / "format" / n for n in ("header.py", "index.py", "dcp_metadata.py")]
    emitted = {m for p in sources for m in pat.findall(p.read_text())} - {"config.json"}
    assert {"dir.lock_file", "layout.leftover", "dcp.bad_metadata", "index.wrong_shard"} <= emitted  # the scan sees them
    assert not sorted(emitted - set(DOCUMENTED)), f"undocumented codes: {sorted(emitted - set(DOCUMENTED))}"
    assert not sorted(set(DOCUMENTED) - emitted), f"documented but never emitted: {sorted(set(DOCUMENTED) - emitted)}"


def test_corpus_covers_most_documented_error_codes() -> None:
    """One builder per check: the codes without a builder are listed here on purpose."""
    built = {c.make.__name__ for c in corpus.CASES}
    assert len(built) >= 90
    covered = set()
    for c in corpus.CASES:
        src = c.make.__code__.co_consts
        covered.update(x for x in src if isinstance(x, str) and x in DOCUMENTED)
    without_builder = {"index.too_large", "dir.shard_too_large", "pickle.html_page",
                       "pickle.tensor_out_of_range", "pickle.not_state_dict", "dcp.path_outside", "dcp.chunk_missing",
                       "layout.two_adapters", "layout.adapter_beside_model", "adapter.empty", "adapter.not_checked",
                       "adapter.base_unavailable", "adapter.missing_optional", "manifest.bad_schema",
                       "manifest.path_outside", "io.error", "config.missing", "config.not_checked",
                       "config.generation_config_missing", "config.tokenizer_missing", "header.dtype_min_version",
                       "deep.all_zero_vector", "deep.not_decoded", "layout.unsafe_index",
                       "adapter.regex_not_checked", "header.not_a_file"}  # covered in test_layout, test_hostile_inputs, below
    assert set(DOCUMENTED) - covered <= without_builder, sorted(set(DOCUMENTED) - covered - without_builder)


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
