"""The model-class check on FP8 block-quantized checkpoints (issue 30): the layout DeepSeek-V3 and
Qwen3-FP8 ship (``*.weight`` float8_e4m3fn beside ``*.weight_scale_inv`` float32 of
``[ceil(out/B), ceil(in/B)]``, ``quantization_config`` fp8 with ``weight_block_size [B, B]``),
built here from real tiny transformers models, quantized per block in the test and saved with
safetensors.

Two loaders judge each case. ``from_pretrained`` on this machine (no GPU): transformers' quantizer
falls back to dequantizing on load, reading the block size from each stored scale grid. And the
fp8 layers (``FP8Linear``/``FP8Experts``, what from_pretrained builds where fp8 kernels run):
transformers' own ``_load_pretrained_model`` and ``_finalize_model_loading`` with the quantizer
``AutoHfQuantizer`` makes from config.json, every step of from_pretrained but the environment
check that switches a CPU to dequantizing. verify judges the fp8 layers, on any machine."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ecosystem import fresh_copy
from test_verify_ecosystem import _codes, _drop, _edit_config, _edit_tensors

from ckptctl.findings import ERROR, WARNING
from ckptctl.verify import VerifyOptions, verify_path
from tests.support import clean_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")
STATIC = VerifyOptions(static=True)
B = 16  # the block of the tiny models (DeepSeek-V3 and Qwen3-FP8 ship 128)
FP8 = {"quant_method": "fp8", "weight_block_size": [B, B], "activation_scheme": "dynamic", "fmt": "e4m3"}
EXPERT = re.compile(r"\.experts\.\d+\.\w+_proj\.weight$")


def quantize(w, block: int):
    """(float8_e4m3fn weight, float32 weight_scale_inv of [ceil(out/B), ceil(in/B)]): DeepSeek-V3's
    per-block scheme, a partial block at the edge included."""
    out, inp = w.shape
    so, si = math.ceil(out / block), math.ceil(inp / block)
    pad = torch.zeros(so * block, si * block)
    pad[:out, :inp] = w.float()
    tiles = pad.reshape(so, block, si, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, None, :, None]).reshape(so * block, si * block)[:out, :inp]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def save_fp8(model, d: Path, block: int = B) -> Path:
    """``save_pretrained``, then every Linear weight (the experts' too; lm_head and the router stay
    as they are, as transformers' quantizer leaves them) stored as fp8 with its scales."""
    model.save_pretrained(d)
    p = d / "model.safetensors"
    tensors = st.load_file(p)
    for k in [k for k in tensors if k.endswith(".weight") and not k.startswith("lm_head")]:
        if EXPERT.search(k) or type(model.get_submodule(k.removesuffix(".weight"))) is torch.nn.Linear:
            tensors[k], tensors[k.removesuffix("weight") + "weight_scale_inv"] = quantize(tensors[k], block)
    st.save_file(tensors, p, metadata={"format": "pt"})
    _edit_config(d, quantization_config=FP8)
    return d


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (an fp8 checkpoint, the float model it was quantized from)."""
    from ecosystem.transformers_models import make_model

    root = tmp_path_factory.mktemp("fp8")
    built = {}
    for name, model_type, over in [("llama", "llama", {}), ("deepseek_v3", "deepseek_v3", {}),
                                   ("partial", "llama", {"intermediate_size": 40})]:
        model = make_model(model_type, **over)
        built[name] = (save_fp8(model, root / name), model)
    return built


def _copy(fp8, name: str, tmp_path: Path) -> Path:
    return fresh_copy(fp8[name][0], tmp_path / name)


def cpu_load(d: Path):
    """transformers' from_pretrained here: (model, loading info without its empty entries)."""
    cls = getattr(transformers, json.loads((d / "config.json").read_text())["architectures"][0])
    model, info = cls.from_pretrained(d, output_loading_info=True)
    return model, {k: v for k, v in info.items() if v}


def fp8_layers_load(d: Path):
    """from_pretrained's steps where fp8 runs: the quantizer from config.json, ``preprocess_model``,
    its weight conversions, transformers' own loading and finalising (which raises on a mismatch)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.utils.generic import ContextManagers

    cls = getattr(transformers, json.loads((d / "config.json").read_text())["architectures"][0])
    config = cls.config_class.from_pretrained(d)
    quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    config.quantization_config = quantizer.quantization_config
    dtype = torch.float32
    with ContextManagers(cls.get_init_context(dtype, True, False, None)):
        model = cls(config)
        quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    lc = LoadStateDictConfig(pretrained_model_name_or_path=str(d), ignore_mismatched_sizes=False, dtype=dtype,
                             dtype_plan=model._get_dtype_plan(dtype), hf_quantizer=quantizer,
                             weight_mapping=get_model_conversion_mapping(model, None, quantizer))
    info, _ = cls._load_pretrained_model(model, None, [str(d / "model.safetensors")], lc)
    info = cls._finalize_model_loading(model, lc, info)
    return model, info


def _class_ran(res) -> None:
    assert "model-class" in res.checks.ran, res.checks.skipped  # before issue 30: a note, never built
    assert "config.class_not_checked" not in _codes(res)


def _only_static_misses(d: Path, code: str) -> None:
    static = _codes(verify_path(d, options=STATIC))
    assert code not in static and ERROR not in static.values(), static


def _outcomes_agree(d: Path):
    """check_transformers' fast matching and transformers' own function give the same outcome."""
    from ckptctl.verify.classes import loaded_family
    from ckptctl.verify.classes.transformers_class import check_transformers
    from ckptctl.verify.context import Context
    from ckptctl.verify.pipeline import weights_step
    from ckptctl.verify.report import PathResult
    from ckptctl.verify.screen import scan_directory

    ctx = Context(d, PathResult(str(d), str(d)), VerifyOptions())
    scan_directory(ctx)
    weights_step(ctx)
    tensors, cfg = loaded_family(ctx).tensors, json.loads((d / "config.json").read_text())
    fast, ref = check_transformers(cfg, tensors, str(d)), check_transformers(cfg, tensors, str(d), fast=False)
    assert fast == ref
    return fast


# -- clean checkpoints --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_a_clean_fp8_checkpoint_loads_and_verifies_clean(fp8, name: str) -> None:
    """Both loaders take every tensor (DeepSeek-V3: MLA projections, fused experts with their
    scales); the CPU one dequantizes to the original weights within fp8's error; verify builds
    the fp8 class and finds nothing."""
    d, original = fp8[name]
    model, info = cpu_load(d)
    assert info == {}
    key = "model.layers.1.self_attn.o_proj.weight"
    want, got = original.state_dict()[key], model.state_dict()[key].float()
    assert (got - want).abs().max() <= 0.07 * want.abs().max()
    layers, info = fp8_layers_load(d)
    assert not (info.missing_keys or info.unexpected_keys or info.mismatched_keys or info.conversion_errors)
    assert type(layers.get_submodule(key.removesuffix(".weight"))).__name__ == "FP8Linear"
    res = verify_path(d)
    _class_ran(res)
    assert not [f for f in res.findings if f.severity in (ERROR, WARNING)], res.findings
    assert not _outcomes_agree(d).missing


def test_a_partial_block_is_the_fp8_layers_layout(fp8, tmp_path: Path) -> None:
    """40 rows in blocks of 16: a [3, 2] grid whose last block is partial (DeepSeek-V3's 576-row
    kv_a_proj_with_mqa at B=128). The fp8 layers load it; the CPU dequantizer of transformers
    refuses every such weight (it cannot split 40 rows into 3 equal blocks). verify judges the
    checkpoint, not the machine: clean."""
    d = fp8["partial"][0]
    _, info = fp8_layers_load(d)
    assert not (info.missing_keys or info.mismatched_keys or info.conversion_errors)
    with pytest.raises(RuntimeError, match="conversion"):
        cpu_load(d)
    res = verify_path(d)
    _class_ran(res)
    assert ERROR not in _codes(res).values()


# -- breakages ------------------------------------------------------------------------------------------

def test_config_block_size_disagrees_with_the_packing(fp8, tmp_path: Path) -> None:
    """Packed in blocks of 16, config.json says 32: every scale grid has the wrong block count. The
    fp8 layers raise (size mismatch); on this machine transformers dequantizes with each stored
    grid and loads the original weights, the disagreement unseen."""
    d = _copy(fp8, "llama", tmp_path)
    _edit_config(d, quantization_config={**FP8, "weight_block_size": [32, 32]})
    res = verify_path(d)
    _class_ran(res)
    found = {f.tensor: f for f in res.findings if f.code == "config.class_shape"}
    scales = {k for k in st.load_file(d / "model.safetensors") if k.endswith("weight_scale_inv")}
    assert set(found) == scales and all(f.severity == ERROR for f in found.values())
    q = found["model.layers.0.self_attn.q_proj.weight_scale_inv"].details
    assert (q["stored"], q["expected"]) == ([2, 2], [1, 1])
    _only_static_misses(d, "config.class_shape")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        fp8_layers_load(d)
    _, info = cpu_load(d)
    assert info == {}
    _outcomes_agree(d)


def test_one_scale_with_another_block_count(fp8, tmp_path: Path) -> None:
    """One projection's scales saved for another block count (a [3, 2] grid for a 32x32 weight):
    both loaders raise (the fp8 layers: size mismatch; the CPU dequantizer: the grid does not
    divide the weight, a conversion error)."""
    d = _copy(fp8, "llama", tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    _edit_tensors(d, lambda t: t.update({key: torch.ones(3, 2)}))
    _one_shape_both_loaders_raise(d, key, [3, 2], [2, 2])


def _one_shape_both_loaders_raise(d: Path, tensor: str, stored: list[int], expected: list[int]) -> None:
    """verify gives one config.class_shape (the static rules none); the fp8 layers raise (size
    mismatch) and the CPU dequantizer raises (a conversion error); both matchings agree."""
    res = verify_path(d)
    _class_ran(res)
    found = [f for f in res.findings if f.code == "config.class_shape"]
    assert [(f.tensor, f.severity, f.details["stored"], f.details["expected"]) for f in found] == \
        [(tensor, ERROR, stored, expected)]
    _only_static_misses(d, "config.class_shape")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        fp8_layers_load(d)
    with pytest.raises(RuntimeError, match="conversion"):
        cpu_load(d)
    _outcomes_agree(d)


def test_a_missing_weight_scale_inv(fp8, tmp_path: Path) -> None:
    """A weight without its scales. The fp8 layers warn (MISSING) and keep an uninitialised scale;
    on this machine transformers loads the fp8 values unscaled and reports nothing (the weight is
    hundreds of times too large): the model silently changes."""
    d = _copy(fp8, "llama", tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    _edit_tensors(d, _drop(key))
    res = verify_path(d)
    _class_ran(res)
    missing = [f for f in res.findings if f.code == "config.class_missing"]
    assert len(missing) == 1 and missing[0].severity == ERROR and missing[0].details["keys"] == [key]
    _only_static_misses(d, "config.class_missing")
    _, info = fp8_layers_load(d)
    assert info.missing_keys == {key}
    model, info = cpu_load(d)
    assert info == {}
    weight = key.removesuffix("_scale_inv")
    assert model.state_dict()[weight].abs().max() > 50 * fp8["llama"][1].state_dict()[weight].abs().max()
    assert _outcomes_agree(d).missing == [key]


def test_an_experts_missing_scale(fp8, tmp_path: Path) -> None:
    """DeepSeek-V3's experts are stored one per tensor and loaded fused (with their scales fused
    by the quantizer's copy of the expert converter): one expert's scale missing leaves the fused
    scale an expert short. Both loaders raise (the fp8 layers: size mismatch; the CPU
    dequantizer: weight/scale count mismatch, a conversion error)."""
    d = _copy(fp8, "deepseek_v3", tmp_path)
    _edit_tensors(d, _drop("model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"))
    _one_shape_both_loaders_raise(d, "model.layers.1.mlp.experts.down_proj_scale_inv", [3, 2, 1], [4, 2, 1])


# -- what stays a note ---------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, words", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, "a checkpoint quantized with gptq"),
    ({"quantization_config": {**FP8, "weight_block_size": None}}, "per-tensor scales"),
    ({"quantization_config": {**FP8, "scale_fmt": "ue8m0"}}, "'ue8m0' scales"),
    ({"quantization_config": None, "compression_config": {"quant_method": "compressed-tensors"}}, "compressed-tensors"),
], ids=["gptq", "per-tensor", "ue8m0", "compressed"])
def test_other_quantizations_are_notes_that_say_which(fp8, tmp_path: Path, edit: dict, words: str) -> None:
    d = _copy(fp8, "llama", tmp_path)
    _edit_config(d, **edit)
    res = verify_path(d)
    note = next(f for f in res.findings if f.code == "config.class_not_checked")
    assert words in note.message and note.severity == "info"
    assert res.checks.skipped["model-class"] == note.details["reason"]


def test_a_quantizer_that_refuses_the_environment_is_a_note(fp8, tmp_path: Path) -> None:
    """Without accelerate (hidden from real interpreters: verify's and its class-check child's),
    transformers' fp8 quantizer refuses to load (ImportError), and from_pretrained raises; verify
    says so, in the quantizer's own words."""
    d = fp8["llama"][0]
    # Python refuses to import a module whose sys.modules entry is None: as if not installed, in every
    # process started with this PYTHONPATH (the box's child included)
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['accelerate'] = None\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    code = (
        "import json, sys\n"
        "from ckptctl.verify import verify_path\nimport transformers\n"
        f"res = verify_path({str(d)!r})\n"
        "note = [f.message for f in res.findings if f.code == 'config.class_not_checked']\n"
        "try:\n    transformers.LlamaForCausalLM.from_pretrained(sys.argv[1]); raised = ''\n"
        "except ImportError as exc:\n    raised = str(exc)\n"
        "print(json.dumps({'note': note, 'raised': raised}))\n")
    p = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120,
                       env=clean_env({"PYTHONWARNINGS": "ignore", "PYTHONPATH": path}), check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "requires accelerate" in out["raised"]
    assert len(out["note"]) == 1 and "fp8 quantizer refuses this environment: ImportError" in out["note"][0]
    assert "requires accelerate" in out["note"][0]


@pytest.mark.parametrize("block", [[0, 0], [16]], ids=["zero", "one-number"])
def test_a_weight_block_size_transformers_refuses(fp8, tmp_path: Path, block: list[int]) -> None:
    """A quantization_config whose fp8 config transformers refuses: from_pretrained raises
    (ValueError), so verify reports config.class_refused (an error, not a note); the static rules
    alone say nothing."""
    d = _copy(fp8, "llama", tmp_path)
    _edit_config(d, quantization_config={**FP8, "weight_block_size": block})
    with pytest.raises(ValueError, match="weight_block_size"):
        cpu_load(d)
    res = verify_path(d)
    assert _codes(res)["config.class_refused"] == ERROR
    refused = [f for f in res.findings if f.code == "config.class_refused"]
    assert len(refused) == 1 and refused[0].severity == ERROR and "quantizer's config raises ValueError" in \
        refused[0].message
    _only_static_misses(d, "config.class_refused")
