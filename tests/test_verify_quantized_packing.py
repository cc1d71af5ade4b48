"""A GPTQ or AWQ checkpoint whose quantization_config disagrees with how its tensors are packed
(issue 45): verify reports config.quant_packing_mismatch (an error) from config.json and the
headers, in both modes; transformers with GPT-QModel (the library its GPTQ and AWQ quantizers run
on) stops at load with a size mismatch on the same file. A GPTQ file without g_idx loads, and the
first forward breaks: config.quant_g_idx_missing.

The checkpoints are the library's own: a tiny Llama whose config.json carries the quantization_config
is loaded by ``from_pretrained`` (GPT-QModel's CPU kernels replace its linears, with the buffers the
config asks for), GPTQ layers are packed with GPT-QModel's ``hf_pack`` from the fp16 weights (AWQ
layers get random codes in the buffers the library made: their shapes are what is judged), and
the tensors are saved with safetensors. The library runs in a child process (it patches
transformers when imported)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from tests.support import clean_env
from tests.support.cli import invoke

pytest.importorskip("transformers")
pytest.importorskip("gptqmodel")
pytest.importorskip("optimum")

LIBRARY = r'''
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

def build(out, quant):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
    fp = LlamaForCausalLM(cfg).to(torch.float16)
    fp.save_pretrained(out)
    doc = json.load(open(os.path.join(out, "config.json")))
    doc["quantization_config"] = quant
    json.dump(doc, open(os.path.join(out, "config.json"), "w"))
    qm = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16)  # the library's layers, fp weights unused
    linears, sd = dict(fp.named_modules()), load_file(os.path.join(out, "model.safetensors"))
    bits, gs = quant["bits"], quant["group_size"]
    for name, mod in qm.named_modules():
        if not hasattr(mod, "qweight") or name not in linears:
            continue
        if quant["quant_method"] == "gptq":
            w = linears[name].weight.data.float()
            groups = w.reshape(w.shape[0], -1, gs)
            mx, mn = groups.amax(-1), groups.amin(-1)
            scale = ((mx - mn) / (2 ** bits - 1)).clamp(min=1e-5)
            zero = torch.round(-mn / scale).clamp(0, 2 ** bits - 1)
            mod.hf_pack(linears[name], scale.half(), zero, torch.arange(w.shape[1], dtype=torch.int32) // gs,
                        checkpoint_format="gptq")
            keys = ("qweight", "qzeros", "scales", "g_idx")
        else:
            g = torch.Generator().manual_seed(1)
            mod.qweight.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, mod.qweight.shape, generator=g, dtype=torch.int64))
            mod.qzeros.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, mod.qzeros.shape, generator=g, dtype=torch.int64))
            mod.scales.copy_(torch.rand(mod.scales.shape, generator=g) * 1e-3)
            keys = ("qweight", "qzeros", "scales")
        del sd[name + ".weight"]
        for k in keys:
            sd[f"{name}.{k}"] = getattr(mod, k).detach().contiguous().clone()
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

def use(d):
    """The first use: load, then logits of a few tokens."""
    try:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float16)
        with torch.no_grad():
            logits = model(torch.arange(8)[None]).logits.float()
        return {"ok": bool(torch.isfinite(logits).all()), "error": "", "logits": logits.flatten().tolist()}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "logits": None}

if sys.argv[1] == "build":
    build(sys.argv[2], json.loads(sys.argv[3]))
else:  # the library writes its banner to stdout: the answer goes to a file
    json.dump({d: use(d) for d in sys.argv[3:]}, open(sys.argv[2], "w"))
'''

# gptq_v2: the zero points as hf_pack writes them (a v1 file stores each less one); the reloaded
# layers then compute what the quantization gives, to fp16 rounding. The packed shapes are v1's.
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq_v2"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def _library(*args: str) -> None:
    p = subprocess.run([sys.executable, "-c", LIBRARY, *args], capture_output=True, text=True, timeout=600,
                       env=clean_env({"PYTHONWARNINGS": "ignore"}), check=False)
    assert p.returncode == 0, p.stderr[-3000:]


def _use(tmp: Path, *dirs: Path) -> dict[str, dict]:
    """Each checkpoint's first use by the library: {"ok", "error", "logits"} by path."""
    out = tmp / "used.json"
    _library("use", str(out), *(str(d) for d in dirs))
    return json.loads(out.read_text())


def _build(tmp_path_factory, quant: dict) -> Path:
    d = tmp_path_factory.mktemp(quant["quant_method"]) / "model"
    _library("build", str(d), json.dumps(quant))
    return d


@pytest.fixture(scope="module")
def gptq(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, GPTQ)


@pytest.fixture(scope="module")
def awq(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, AWQ)


@pytest.fixture(scope="module", params=["gptq", "awq"])
def quantized(request) -> Path:
    return request.getfixturevalue(request.param)


def _edit(src: Path, dst: Path, **fields: object) -> Path:
    shutil.copytree(src, dst)
    doc = json.loads((dst / "config.json").read_text())
    doc["quantization_config"].update(fields)
    (dst / "config.json").write_text(json.dumps(doc))
    return dst


def _findings(d: Path, *args: str) -> tuple[int, dict[str, dict]]:
    r = invoke("verify", d, "--json", *args)
    doc = json.loads(r.stdout)
    return r.exit_code, {f["code"]: f for res in doc["results"] for f in res["findings"]}


def test_the_checkpoint_the_library_wrote_passes_and_runs(quantized, tmp_path):
    used = _use(tmp_path, quantized)
    assert used[str(quantized)]["ok"] and used[str(quantized)]["error"] == ""
    for args in ((), ("--static",)):
        rc, found = _findings(quantized, *args)
        assert rc == 0 and not {"config.quant_packing_mismatch", "config.quant_packing_not_checked",
                                "config.quant_g_idx_missing"} & set(found), found


DAMAGE = [({"bits": 8}, ["bits"]), ({"bits": 2}, ["bits"]), ({"bits": 3}, ["bits"]),
          ({"group_size": 16}, ["group_size"]), ({"group_size": 64}, ["group_size"]),
          ({"group_size": -1}, ["group_size"])]


def test_bits_or_group_size_edited_is_a_packing_mismatch_the_library_fails_on(quantized, tmp_path):
    cases = [(_edit(quantized, tmp_path / f"d{i}", **fields), fields, blamed)
             for i, (fields, blamed) in enumerate(DAMAGE)]
    used = _use(tmp_path, *(d for d, _, _ in cases))
    for d, fields, blamed in cases:
        error = used[str(d)]["error"]
        assert not used[str(d)]["ok"] and ("size mismatch" in error.lower() or "ignore_mismatched_sizes" in error), \
            (fields, used[str(d)])
        for args in ((), ("--static",)):
            rc, found = _findings(d, *args)
            assert rc == 1 and found["config.quant_packing_mismatch"]["severity"] == "error", (fields, found)
            details = found["config.quant_packing_mismatch"]["details"]
            assert details["fields"] == blamed and details["layers"] == 7, (fields, details)


def test_a_packing_the_check_does_not_know_is_said_not_an_error(quantized, tmp_path):
    d = _edit(quantized, tmp_path / "dyn", dynamic={r"-:.*down_proj": {}})
    rc, found = _findings(d, "--static")
    assert rc == 0 and found["config.quant_packing_not_checked"]["severity"] == "info", found


def test_a_gptq_file_without_g_idx_is_an_error_the_library_breaks_on(gptq, tmp_path):
    # transformers leaves a buffer the file lacks uninitialised: g_idx then indexes the scales with
    # whatever the memory held (an IndexError, or another model where it happens to be in range)
    d = Path(shutil.copytree(gptq, tmp_path / "no-g_idx"))
    tensors = load_file(d / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith(".g_idx")}, d / "model.safetensors",
              metadata={"format": "pt"})
    used = _use(tmp_path, gptq, d)
    clean, broken = used[str(gptq)], used[str(d)]
    assert clean["ok"] and (not broken["ok"] or broken["logits"] != clean["logits"]), broken["error"]
    for args in ((), ("--static",)):
        rc, found = _findings(d, *args)
        assert rc == 1 and found["config.quant_g_idx_missing"]["severity"] == "error", found
        assert found["config.quant_g_idx_missing"]["details"]["layers"] == 7
        assert "config.quant_packing_mismatch" not in found, found
