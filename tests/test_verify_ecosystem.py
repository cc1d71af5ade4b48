"""verify over the real-library corpus (tests/ecosystem): every clean output passes with no error
and no warning (default and --deep), except the warnings that are right, each listed with why;
and every class of silent breakage that transformers loads without an error today, built by
breaking a real library's output, gives its code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptctl.findings import ERROR, WARNING
from ckptctl.verify import VerifyOptions, verify_path, verify_paths
from ecosystem import ENTRIES, fresh_copy, missing_libraries
from tests.support import CKPTCTL, drop_dac_caps

pytest_plugins = ["ecosystem.fixtures"]
STATIC = VerifyOptions(static=True)  # the static rules alone (the fallback where the class check cannot run)
torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

# Warnings that are right on a clean library output: (entry, code) -> why.
RIGHT_WARNINGS = {
    ("safetensors/save-model", "header.format_missing"):
        "safetensors.torch.save_model writes no __metadata__.format; huggingface_hub's and transformers' "
        "loaders expect 'pt' (transformers refuses a file without it as not saved by torch)",
    **{(f"peft/{n}", "adapter.missing_optional"):
       "the corpus's peft base model is built from a config, so peft writes base_model_name_or_path: null; "
       "AutoPeftModel cannot find the base model of such an upload"
       for n in ("lora", "dora", "lora-modules-to-save", "lora-bin")},
}
# Entries that are trees of checkpoints, verified the way a user points verify at a tree.
TREES = {"transformers/trainer", "transformers/hf-cache"}
NAMES = [e.name for e in ENTRIES]


def _not_info(findings) -> set[tuple[str, str, str]]:
    return {(f.severity, f.code, f.path) for f in findings if f.severity in (ERROR, WARNING)}


# Entries the model-class check has nothing to build for: no config.json beside model weights
# (DCP, adapters, bare state dicts).
NO_CLASS = {"accelerate/save-model", "accelerate/save-state", "dcp/fsdp2", "dcp/fsdp2-train-state", "dcp/single",
            "dcp/train-state", "hub/save-torch-state-dict", "hub/save-torch-state-dict-sharded", "peft/dora",
            "peft/ia3", "peft/lokr", "peft/lora", "peft/lora-bin", "peft/lora-modules-to-save",
            "safetensors/save-file", "safetensors/save-model"}


@pytest.mark.parametrize("deep, static", [(False, False), (True, False), (False, True)],
                         ids=["default", "deep", "static"])
def test_every_real_library_output_verifies_clean(ecosystem: dict[str, Path], deep: bool, static: bool) -> None:
    """0 errors and 0 unexplained warnings with the model-class check on (which ran on every entry
    with a config.json and model weights, diffusers components and the sentence-transformers
    module included) and with it off."""
    assert len(ecosystem) >= 70, sorted(ecosystem)
    problems: dict[str, list] = {}
    right_seen: set[tuple[str, str]] = set()
    no_class: set[str] = set()
    for name, d in sorted(ecosystem.items()):
        opts = VerifyOptions(deep=deep, static=static)
        if name in TREES:
            report = verify_paths([str(d)], recursive=True, options=opts)
            assert len(report.results) >= 1
            findings = report.findings
            results = report.results
        else:
            results = [verify_path(d, options=opts)]
            findings = results[0].findings
        if any("model-class" not in r.checks.ran for r in results):
            no_class.add(name)
        for sev, code, path in sorted(_not_info(findings)):
            if sev == WARNING and (name, code) in RIGHT_WARNINGS:
                right_seen.add((name, code))
                continue
            problems.setdefault(name, []).append((sev, code, path))
    assert not problems, problems
    assert right_seen == set(RIGHT_WARNINGS), set(RIGHT_WARNINGS) - right_seen
    assert no_class == (set(ecosystem) if static else NO_CLASS & set(ecosystem)), no_class


def test_gpt2_names_in_nn_linear_layout_are_still_checked(build_one, tmp_path: Path) -> None:
    """GPT-Neo and GPT-BigCode store GPT-2 names as nn.Linear ([out, in]): no false error on the clean
    output, and a real mismatch still caught (n_inner changed)."""
    for name, field in (("transformers/gpt_neo", "intermediate_size"), ("transformers/gpt_bigcode", "n_inner")):
        d = fresh_copy(build_one(name), tmp_path / name.replace("/", "_"))
        assert not _not_info(verify_path(d, options=STATIC).findings)
        _edit_config(d, **{field: 48})
        assert "config.mlp_shape" in _codes(verify_path(d, options=STATIC)), name
        assert "config.class_shape" in _codes(verify_path(d)), name
    # GPTNeoConfig has no n_inner: the static rule reads it anyway (a false error), the class check
    # builds what transformers builds and loads (nothing to report)
    _edit_config(d := fresh_copy(build_one("transformers/gpt_neo"), tmp_path / "neo2"), n_inner=48)
    assert "config.mlp_shape" in _codes(verify_path(d, options=STATIC))
    assert not _not_info(verify_path(d).findings)


# -- helpers ---------------------------------------------------------------------------------------

def _codes(res) -> dict[str, str]:
    return {f.code: f.severity for f in res.findings}


def _edit_config(d: Path, **changes) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg, indent=2))


def _edit_tensors(d: Path, fn, file: str = "model.safetensors") -> None:
    """Rewrite one safetensors file of a real output with the library's own writer."""
    p = d / file
    tensors = st.load_file(p)
    fn(tensors)
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, p, metadata={"format": "pt"})


def _copy(build_one, name: str, tmp_path: Path) -> Path:
    return fresh_copy(build_one(name), tmp_path / "ckpt")


def _drop(prefix: str):
    def fn(t: dict) -> None:
        for k in [k for k in t if k.startswith(prefix)]:
            del t[k]
        assert not any(k.startswith(prefix) for k in t)
    return fn


# -- silent breakages ------------------------------------------------------------------------------

def test_moe_expert_missing(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/mixtral", tmp_path)
    _edit_tensors(d, _drop("model.layers.1.block_sparse_moe.experts.2."))
    res = verify_path(d)
    assert _codes(res).get("config.expert_missing") == "error"
    f = next(f for f in res.findings if f.code == "config.expert_missing")
    assert f.details["missing"] == [2] and f.details["block"] == "model.layers.1.block_sparse_moe."


@pytest.mark.parametrize("entry,field", [("transformers/deepseek_v3", "n_routed_experts"),
                                         ("transformers/qwen2_moe", "num_experts"),
                                         ("transformers/mixtral", "num_local_experts")])
def test_moe_expert_count_disagrees_with_config(build_one, tmp_path: Path, entry: str, field: str) -> None:
    d = _copy(build_one, entry, tmp_path)
    assert json.loads((d / "config.json").read_text())[field] == 4
    _edit_config(d, **{field: 3})
    res = verify_path(d)
    assert _codes(res).get("config.expert_count") == "error", _codes(res)
    msgs = [f.message for f in res.findings if f.code == "config.expert_count"]
    assert any("router" in m and "scores 4 experts" in m for m in msgs), msgs
    assert any("holds experts 3" in m for m in msgs), msgs


@pytest.mark.parametrize("entry,edit,stack", [
    ("transformers/t5", {"num_decoder_layers": 3}, "decoder.block"),
    ("transformers/bart", {"encoder_layers": 2}, "model.encoder.layers"),
    ("transformers/whisper", {"decoder_layers": 2}, "model.decoder.layers"),
])
def test_encoder_decoder_stack_layers_missing(build_one, tmp_path: Path, entry: str, edit: dict,
                                              stack: str) -> None:
    d = _copy(build_one, entry, tmp_path)
    _edit_config(d, **edit)
    res = verify_path(d, options=STATIC)
    found = [f for f in res.findings if f.code == "config.layer_missing"]
    assert [f.details["stack"] for f in found] == [stack] and found[0].severity == "error", res.findings
    missing = [f for f in verify_path(d).findings if f.code == "config.class_missing"]
    assert missing and all(k.startswith(stack + ".") for k in missing[0].details["keys"])


def test_encoder_decoder_layer_tensors_removed(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/whisper", tmp_path)
    _edit_tensors(d, _drop("model.encoder.layers.0."))
    found = [f for f in verify_path(d, options=STATIC).findings if f.code == "config.layer_missing"]
    assert [(f.details["stack"], f.details["missing"]) for f in found] == [("model.encoder.layers", [0])]
    missing = [f for f in verify_path(d).findings if f.code == "config.class_missing"]
    assert missing and all(k.startswith("model.encoder.layers.0.") for k in missing[0].details["keys"])


@pytest.mark.parametrize("entry,stack", [("transformers/bert", "bert.encoder.layer"),
                                         ("transformers/llama", "model.layers"),
                                         ("transformers/gpt_bigcode", "transformer.h")])
def test_extra_layers_beyond_the_config(build_one, tmp_path: Path, entry: str, stack: str) -> None:
    d = _copy(build_one, entry, tmp_path)
    field = "n_layer" if entry.endswith("gpt_bigcode") else "num_hidden_layers"
    _edit_config(d, **{field: 1})
    found = [f for f in verify_path(d, options=STATIC).findings if f.code == "config.layer_extra"]
    assert [(f.severity, f.details["stack"], f.details["extra"]) for f in found] == [("error", stack, [1])]
    found = [f for f in verify_path(d).findings if f.code == "config.class_disagrees"]
    assert len(found) == 1 and found[0].severity == "error"
    assert all(k.startswith(stack + ".1.") for k in found[0].details["keys"]), found[0].details


def test_mtp_layers_are_not_extra(build_one, tmp_path: Path) -> None:
    """num_nextn_predict_layers allows that many layers after the decoder layers; one more is extra."""
    d = _copy(build_one, "transformers/deepseek_v3", tmp_path)
    _edit_config(d, num_hidden_layers=1)
    assert "config.layer_extra" not in _codes(verify_path(d, options=STATIC))
    assert not {"config.class_disagrees", "config.class_unused"} & set(_codes(verify_path(d)))
    _edit_config(d, num_nextn_predict_layers=0)
    assert _codes(verify_path(d, options=STATIC)).get("config.layer_extra") == "error"
    assert _codes(verify_path(d)).get("config.class_disagrees") == "error"


def test_tied_config_with_a_different_stored_lm_head(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/llama-tied", tmp_path)
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is True

    def add_head(delta: float):
        def fn(t: dict) -> None:
            t["lm_head.weight"] = t["model.embed_tokens.weight"].clone() + delta
        return fn
    _edit_tensors(d, add_head(0.0))
    assert "config.lm_head_tied_differs" not in _codes(verify_path(d, options=VerifyOptions(deep=True)))
    _edit_tensors(d, add_head(1.0))
    assert "config.lm_head_tied_differs" not in _codes(verify_path(d))  # bytes are only read under --deep
    assert _codes(verify_path(d, options=VerifyOptions(deep=True))).get("config.lm_head_tied_differs") == "error"


def test_fp8_weights_without_quantization_config(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/llama", tmp_path)

    def fp8(t: dict) -> None:
        for k in [k for k in t if k.endswith("proj.weight")]:
            t[k] = t[k].to(torch.float8_e4m3fn)
            t[k.removesuffix("weight") + "weight_scale_inv"] = torch.ones(1, 1)
    _edit_tensors(d, fp8)
    assert _codes(verify_path(d)).get("config.quantization_missing") == "error"


def test_gptq_packed_weights_without_quantization_config(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/llama", tmp_path)

    def gptq(t: dict) -> None:
        for k in [k for k in t if k.endswith("mlp.up_proj.weight")]:
            out, inp = t.pop(k).shape
            base = k.removesuffix("weight")
            t[base + "qweight"] = torch.zeros(inp // 8, out, dtype=torch.int32)
            t[base + "qzeros"] = torch.zeros(1, out // 8, dtype=torch.int32)
            t[base + "scales"] = torch.ones(1, out, dtype=torch.float16)
    _edit_tensors(d, gptq)
    assert _codes(verify_path(d)).get("config.quantization_missing") == "error"


def test_quantization_config_with_float_weights(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/llama", tmp_path)
    _edit_config(d, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert _codes(verify_path(d)).get("config.quantization_unused") == "error"


def test_nan_is_an_error_inf_a_warning(build_one, tmp_path: Path) -> None:
    d = _copy(build_one, "transformers/qwen2", tmp_path)

    def poison(value: float):
        def fn(t: dict) -> None:
            t["model.layers.0.mlp.up_proj.weight"][0, 0] = value
        return fn
    _edit_tensors(d, poison(float("inf")))
    codes = _codes(verify_path(d, options=VerifyOptions(deep=True)))
    assert codes.get("deep.inf") == "warning" and "deep.nan" not in codes
    _edit_tensors(d, poison(float("nan")))
    assert _codes(verify_path(d, options=VerifyOptions(deep=True))).get("deep.nan") == "error"


def test_tokenizer_larger_than_the_embedding(build_one, tmp_path: Path) -> None:
    """The sentence-transformers root's real tokenizer.json, beside a config whose vocab_size is smaller."""
    d = _copy(build_one, "sentence-transformers/root", tmp_path)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    top = (max(vocab.values()) if isinstance(vocab, dict) else len(vocab) - 1)
    assert not _not_info(verify_path(d).findings)
    _edit_config(d, vocab_size=top)
    res = verify_path(d)
    assert _codes(res).get("config.tokenizer_vocab") == "error", res.findings


def test_hf_cache_blob_hash_and_dangling_link(build_one, tmp_path: Path) -> None:
    root = fresh_copy(build_one("transformers/hf-cache"), tmp_path / "cache")
    repo = next(root.glob("models--*"))
    snap = next(s for s in (repo / "snapshots").iterdir() if (s / "model.safetensors").exists())
    blob = Path(os.path.realpath(snap / "model.safetensors"))
    assert len(blob.name) == 64 and not _not_info(verify_path(snap, options=VerifyOptions(deep=True)).findings)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the last tensor's data: the header still parses
    blob.write_bytes(bytes(data))
    res = verify_path(snap, options=VerifyOptions(deep=True))
    assert _codes(res).get("deep.blob_hash_mismatch") == "error"
    assert "deep.blob_hash_mismatch" not in _codes(verify_path(snap))
    blob.unlink()  # the snapshot's link now dangles: a missing file
    codes = _codes(verify_path(snap))
    assert any(sev == "error" for sev in codes.values()) and "dir.broken_link" in codes, codes


@pytest.mark.skipif(sys.platform != "linux", reason="capability drop is Linux-only")
def test_recursive_reports_a_directory_it_cannot_read(build_one, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    fresh_copy(build_one("transformers/llama"), tree / "good")
    locked = tree / "locked"
    fresh_copy(build_one("transformers/qwen2"), locked / "inner")
    locked.chmod(0)
    try:
        # --static: about the unreadable directory, not the class (a subprocess pays its import)
        p = subprocess.run([*CKPTCTL, "verify", "--recursive", "--json", "--static", str(tree)], capture_output=True,
                           text=True,
                           timeout=120, preexec_fn=drop_dac_caps if os.geteuid() == 0 else None,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    finally:
        locked.chmod(0o755)
    doc = json.loads(p.stdout)
    assert p.returncode == 3, (p.returncode, p.stderr)
    bad = [r for r in doc["results"] if r["path"] == str(locked)]
    assert len(bad) == 1 and [f["code"] for f in bad[0]["findings"]] == ["io.error"]
    assert any(r["path"] == str(tree / "good") and r["ok"] for r in doc["results"])


def test_file_over_the_hub_limit(build_one, tmp_path: Path) -> None:
    """A sparse file just over huggingface_hub's documented 50 GB per-file limit (no disk used)."""
    from huggingface_hub import constants

    from ckptctl.verify.pipeline import HUB_MAX_FILE_BYTES
    assert HUB_MAX_FILE_BYTES == constants.MAX_HTTP_DOWNLOAD_SIZE == 50 * 10**9
    d = _copy(build_one, "transformers/llama", tmp_path)
    big = d / "training_log.bin"
    with open(big, "wb") as f:
        f.truncate(HUB_MAX_FILE_BYTES + 1)
    res = verify_path(d)
    assert _codes(res).get("dir.file_too_large_for_hub") == "error"
    found = [f for f in res.findings if f.code == "dir.file_too_large_for_hub"]
    assert [(f.severity, f.details["size"]) for f in found] == [("error", HUB_MAX_FILE_BYTES + 1)]
