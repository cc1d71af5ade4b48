"""``ckptctl inspect`` on checkpoints written by the real tools: transformers ``save_pretrained``
(single and sharded), huggingface_hub ``save_torch_state_dict``, a PEFT-layout adapter and
``torch.save`` pickles. Parameter counts must equal ``model.num_parameters()``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import save_file

from ckptctl.inspect import inspect_path


@pytest.fixture(scope="module")
def models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                         max_position_embeddings=64))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))
    return {"llama": llama, "gpt2": gpt2}


@pytest.fixture(scope="module")
def ckpts(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect")
    out = {}
    llama, gpt2 = models["llama"], models["gpt2"]
    out["llama_single"] = root / "llama_single"
    llama.save_pretrained(out["llama_single"])
    out["llama_sharded"] = root / "llama_sharded"
    llama.save_pretrained(out["llama_sharded"], max_shard_size="20KB")
    out["gpt2_single"] = root / "gpt2_single"
    gpt2.save_pretrained(out["gpt2_single"])
    out["gpt2_hub"] = root / "gpt2_hub"
    out["gpt2_hub"].mkdir()
    save_torch_state_dict(gpt2.state_dict(), out["gpt2_hub"], max_shard_size="40KB")
    out["llama_hub"] = root / "llama_hub"
    out["llama_hub"].mkdir()
    save_torch_state_dict(llama.state_dict(), out["llama_hub"])
    out["llama_bin"] = root / "llama_bin"
    out["llama_bin"].mkdir()
    torch.save(llama.state_dict(), out["llama_bin"] / "pytorch_model.bin")
    llama.config.save_pretrained(out["llama_bin"])
    out["gpt2_bin"] = root / "gpt2_bin"
    out["gpt2_bin"].mkdir()
    torch.save(gpt2.state_dict(), out["gpt2_bin"] / "pytorch_model.bin")
    # A PEFT LoRA adapter for the llama, laid out as peft's save_pretrained writes it.
    out["adapter"] = root / "adapter"
    out["adapter"].mkdir()
    g = torch.Generator().manual_seed(1)
    lora = {}
    for i in range(2):
        for proj in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            rows = 32 if proj == "q_proj" else 16
            lora[f"{base}.lora_A.weight"] = torch.randn(8, 32, generator=g)
            lora[f"{base}.lora_B.weight"] = torch.zeros(rows, 8)
    save_file(lora, out["adapter"] / "adapter_model.safetensors", metadata={"format": "pt"})
    (out["adapter"] / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny-llama", "task_type": "CAUSAL_LM", "bias": "none"}))
    out["adapter_params"] = sum(t.numel() for t in lora.values())  # type: ignore[assignment]
    return out


def inspect_json(cli, path: Path, *extra: str) -> dict:
    res = cli("inspect", str(path), "--json", *extra)
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    return json.loads(res.stdout)


def safetensors_keys(d: Path) -> dict[str, str]:
    """tensor name -> file, read with safetensors itself."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = f.name
    return out


SCHEMA_KEYS = {"schema_version", "command", "ok", "tool_version", "path", "format", "files", "tensor_count",
               "tensors", "parameters", "total_bytes", "dtypes", "config", "findings"}


@pytest.mark.parametrize("name,model,fmt", [
    ("llama_single", "llama", "safetensors"),
    ("llama_sharded", "llama", "safetensors-sharded"),
    ("gpt2_single", "gpt2", "safetensors"),
    ("gpt2_hub", "gpt2", "safetensors-sharded"),
    ("llama_hub", "llama", "safetensors"),
])
def test_safetensors_checkpoints(cli, ckpts, models, name: str, model: str, fmt: str) -> None:
    d = ckpts[name]
    doc = inspect_json(cli, d)
    assert SCHEMA_KEYS <= set(doc)
    assert (doc["schema_version"], doc["command"], doc["ok"], doc["format"]) == (1, "inspect", True, fmt)
    assert doc["parameters"] == models[model].num_parameters()
    on_disk = safetensors_keys(d)
    assert {t["name"]: t["file"] for t in doc["tensors"]} == on_disk
    assert doc["tensor_count"] == len(on_disk) == len(doc["tensors"])
    assert [t["name"] for t in doc["tensors"]] == sorted(on_disk)
    for t in doc["tensors"]:
        assert set(t) == {"name", "dtype", "shape", "parameters", "bytes", "file"}
        n = 1
        for s in t["shape"]:
            n *= s
        assert t["parameters"] == n and t["bytes"] == 4 * n and t["dtype"] == "F32"
    assert doc["total_bytes"] == sum(t["bytes"] for t in doc["tensors"]) == 4 * doc["parameters"]
    assert doc["dtypes"] == {"F32": {"tensors": len(on_disk), "parameters": doc["parameters"],
                                     "bytes": doc["total_bytes"]}}
    weights = sorted(f["name"] for f in doc["files"] if f["role"] == "weights")
    assert weights == sorted(set(on_disk.values()))
    for f in doc["files"]:
        assert f["size"] == os.path.getsize(d / f["name"])
    if fmt == "safetensors-sharded":
        assert len(weights) > 1
        assert [f["name"] for f in doc["files"] if f["role"] == "index"] == ["model.safetensors.index.json"]
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == doc["total_bytes"]
    assert doc["findings"] == []


def test_config_summary_llama(cli, ckpts) -> None:
    doc = inspect_json(cli, ckpts["llama_sharded"])
    assert doc["config"] == {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "intermediate_size": 64, "vocab_size": 256, "dtype": "float32",
                             "tie_word_embeddings": False}
    extras = sorted(f["name"] for f in doc["files"] if f["role"] == "extra")
    assert extras == ["config.json", "generation_config.json"]


def test_config_summary_gpt2_aliases(cli, ckpts) -> None:
    cfg = inspect_json(cli, ckpts["gpt2_single"])["config"]
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["vocab_size"]) == ("gpt2", 32, 2, 2, 256)


def test_single_file_path(cli, ckpts, models) -> None:
    doc = inspect_json(cli, ckpts["llama_single"] / "model.safetensors")
    assert doc["format"] == "safetensors"
    assert doc["parameters"] == models["llama"].num_parameters()
    assert [f["name"] for f in doc["files"]] == ["model.safetensors"]
    assert doc["config"] == {}  # a lone file has no config beside it that belongs to it


def test_peft_adapter(cli, ckpts) -> None:
    doc = inspect_json(cli, ckpts["adapter"])
    assert doc["format"] == "peft"
    assert doc["parameters"] == ckpts["adapter_params"]
    assert doc["tensor_count"] == 8
    assert all(t["name"].startswith("base_model.model.") for t in doc["tensors"])
    assert {f["name"]: f["role"] for f in doc["files"]} == {"adapter_model.safetensors": "weights",
                                                           "adapter_config.json": "extra"}


@pytest.mark.parametrize("name,model", [("llama_bin", "llama"), ("gpt2_bin", "gpt2")])
def test_pytorch_bin(cli, ckpts, models, name: str, model: str) -> None:
    doc = inspect_json(cli, ckpts[name])
    m = models[model]
    assert doc["format"] == "pytorch"
    assert doc["parameters"] == m.num_parameters()
    assert doc["tensor_count"] == len(m.state_dict()) - len(doc.get("aliases", {}))
    if model == "gpt2":  # tied: the head shares the embedding's storage and is listed as an alias
        assert doc["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    else:
        assert "aliases" not in doc
        assert doc["config"]["model_type"] == "llama"
    assert {t["file"] for t in doc["tensors"]} == {"pytorch_model.bin"}


def test_filter(cli, ckpts) -> None:
    full = inspect_json(cli, ckpts["llama_sharded"])
    doc = inspect_json(cli, ckpts["llama_sharded"], "--filter", "model.layers.1.*")
    expected = [t for t in full["tensors"] if t["name"].startswith("model.layers.1.")]
    assert doc["tensors"] == expected and len(expected) == 9
    assert doc["tensor_count"] == 9
    assert doc["parameters"] == sum(t["parameters"] for t in expected)
    none = inspect_json(cli, ckpts["llama_sharded"], "--filter", "no.such.*")
    assert none["tensors"] == [] and none["parameters"] == 0


def test_text_output(cli, ckpts, models) -> None:
    d = ckpts["llama_sharded"]
    plain = cli("inspect", str(d))
    assert plain.exit_code == 0 and plain.stderr == ""
    assert f"{models['llama'].num_parameters():,}" in plain.stdout
    assert "safetensors-sharded" in plain.stdout and "model.safetensors.index.json" in plain.stdout
    assert "model.layers.1.mlp.down_proj.weight" not in plain.stdout  # tensors only on request

    listed = cli("inspect", str(d), "--tensors")
    assert listed.exit_code == 0
    for name in safetensors_keys(d):
        # Piped output is never truncated to the terminal width: every full name is there.
        assert name in listed.stdout

    filtered = cli("inspect", str(d), "--filter", "*.mlp.*")
    assert filtered.exit_code == 0
    assert "model.layers.0.mlp.gate_proj.weight" in filtered.stdout
    assert "model.layers.0.self_attn.q_proj.weight" not in filtered.stdout


def test_long_and_markup_names_survive_text_output(cli, tmp_path: Path) -> None:
    names = ["model.layers.123.block_sparse_moe.experts.77.w2_scale_inv.weight_scale_2", "[bold]x[/bold]",
             "a" * 150]
    save_file({n: torch.zeros(2) for n in names}, tmp_path / "model.safetensors")
    res = cli("inspect", str(tmp_path), "--tensors")
    assert res.exit_code == 0
    for n in names:
        assert n in res.stdout


def test_findings_are_reported(cli, ckpts, tmp_path: Path) -> None:
    d = tmp_path / "leftover"
    d.mkdir()
    for f in ckpts["llama_single"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / ".tmpAbc123").write_bytes(b"partial")
    doc = inspect_json(cli, d)
    assert [f["code"] for f in doc["findings"]] == ["layout.leftover"]
    assert {"name": ".tmpAbc123", "size": 7, "role": "leftover"} in doc["files"]
    text = cli("inspect", str(d))
    assert text.exit_code == 0
    assert "layout.leftover" in text.stderr and "layout.leftover" not in text.stdout


def test_library_api(ckpts, models) -> None:
    res = inspect_path(ckpts["llama_sharded"])
    assert res.parameters == models["llama"].num_parameters()
    assert {s["name"] for s in res.shards()} == set(safetensors_keys(ckpts["llama_sharded"]).values())
    assert sum(s["parameters"] for s in res.shards()) == res.parameters


# ------------------------------------------------------------------------------------------
# The README's example checkpoint

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama"


def _make_tiny():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny", EXAMPLE.parent / "make_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_is_small_and_inspectable(cli) -> None:
    from transformers import LlamaForCausalLM

    files = sorted(p.name for p in EXAMPLE.iterdir())
    assert files == ["config.json", "generation_config.json", "pytorch_model.bin"]
    assert sum(p.stat().st_size for p in EXAMPLE.iterdir()) < 1_000_000
    doc = inspect_json(cli, EXAMPLE)
    assert doc["format"] == "pytorch" and doc["findings"] == []
    assert doc["parameters"] == LlamaForCausalLM(_make_tiny().config()).num_parameters()
    assert doc["config"]["hidden_size"] == 32 and doc["config"]["num_hidden_layers"] == 2
    assert doc["config"]["vocab_size"] == 256 and doc["config"]["architectures"] == ["LlamaForCausalLM"]


def test_example_regenerates_byte_identical(tmp_path: Path) -> None:
    """Byte for byte, except the ``transformers_version`` the config files record: the version of
    the library that regenerates them (a new transformers release is not a changed example)."""
    import re

    version = re.compile(rb'"transformers_version": "[^"]*"')
    written = _make_tiny().make(tmp_path)
    for path in written:
        new, shipped = (version.sub(b'"transformers_version": ""', p.read_bytes()) for p in (path, EXAMPLE / path.name))
        assert new == shipped, f"examples/tiny-llama/{path.name} differs: run `python examples/make_tiny.py`"


def test_dcp_checkpoint(cli, models, tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process without a process group, as intended
        dcp.save(models["llama"].state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    doc = inspect_json(cli, tmp_path / "dcp")
    assert doc["format"] == "dcp"
    assert doc["parameters"] == models["llama"].num_parameters()
    assert {t["name"] for t in doc["tensors"]} == set(models["llama"].state_dict())


def test_variants_beside_the_family_read_are_listed_not_counted(tmp_path):
    """``model.fp16.safetensors`` beside ``model.safetensors``: the main family is counted, the
    variant listed with role ``variant`` (it is another slot, never part of the count)."""
    main = {"a": torch.zeros(4, 4), "b": torch.zeros(3)}
    save_file(main, str(tmp_path / "model.safetensors"))
    save_file({k: v.half() for k, v in main.items()}, str(tmp_path / "model.fp16.safetensors"))
    doc = inspect_path(tmp_path).to_dict()
    assert doc["parameters"] == 19 and doc["tensor_count"] == 2
    assert {f["name"]: f["role"] for f in doc["files"]} == {"model.safetensors": "weights",
                                                            "model.fp16.safetensors": "variant"}


def test_json_rows_are_json_dumps_bytes_whatever_the_names(cli, tmp_path: Path) -> None:
    """The tensor rows are written a chunk at a time, a chunk of plain names without encoding
    each: over several chunks, names that JSON escapes (a quote, a backslash, a newline, a tab)
    in some chunks only, the document is byte for byte what ``json.dumps`` gives for it."""
    odd = {1000: 'q"uote', 5000: "back\\slash", 9000: "new\nline", 9001: "t\tab", 9002: "ünï"}
    names = [odd.get(i, f"layer.{i:05d}.weight") for i in range(13_000)]
    save_file({n: torch.zeros(1 + i % 3) for i, n in enumerate(names)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    res = cli("inspect", str(tmp_path), "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert res.stdout == json.dumps(doc, ensure_ascii=False) + "\n"
    assert sorted(t["name"] for t in doc["tensors"]) == sorted(names)
    assert {t["name"]: t["shape"] for t in doc["tensors"]}['q"uote'] == [1 + 1000 % 3]
