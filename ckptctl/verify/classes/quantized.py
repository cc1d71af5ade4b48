"""Quantized checkpoints in the transformers class check (issue 30): which ones the check builds,
and the quantizer it builds them with.

FP8 block-quantized checkpoints (``quant_method: "fp8"`` with a ``weight_block_size``: DeepSeek-V3,
Qwen3-FP8) are built as ``from_pretrained`` builds them: the quantizer ``get_hf_quantizer`` makes
from config.json (``AutoHfQuantizer``, ``pre_quantized``), checked against this environment by
its own ``validate_environment``; ``preprocess_model`` replaces the Linear layers with
``FP8Linear``/``FP8Experts`` (each weight beside its ``weight_scale_inv`` of
``[ceil(out/B0), ceil(in/B1)]``), and ``get_model_conversion_mapping`` takes its
``update_weight_conversions`` (scale renames, fused-expert copies for the scales).

The form judged is the quantized one, on every machine. Without a GPU (or one below compute
capability 8.9) ``validate_environment`` switches transformers to dequantizing on load, which
derives the block from each stored scale grid: it loads a weight without its scale unscaled and
silently, ignores a ``weight_block_size`` that disagrees with the packing, and refuses a correct
grid with a partial block (DeepSeek-V3's 576-row ``kv_a_proj_with_mqa``). Those are facts of the
machine, not of the checkpoint, so verify's answer does not depend on where it runs.

Every other quantization (another ``quant_method``, ``compression_config``, per-tensor fp8 scales,
``ue8m0`` scales, fp4 experts, fp8 embeddings, a config asking to dequantize) stays a note that
says which method and why (:func:`not_built`). Nothing here imports a library at import time.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from ckptctl.verify.classes.outcome import NotChecked, Outcome

BUILT_METHOD = "fp8"
# FineGrainedFP8Config's defaults for the fields that decide the layout
FP8_DEFAULTS = (("weight_block_size", (128, 128)), ("scale_fmt", "float"), ("expert_dtype", "fp8"), ("dequantize", False))
ONLY = "the class check builds only fp8 block-quantized checkpoints"


def method_name(q: dict[str, Any]) -> str:
    """The quantization method a quantization_config names (as ``AutoQuantizationConfig`` reads it)."""
    if q.get("load_in_4bit") is True or q.get("load_in_8bit") is True:
        return "bitsandbytes"
    m = q.get("quant_method")
    return m if isinstance(m, str) else repr(m)


def quantization(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (or ``compression_config``), or None."""
    for key in ("quantization_config", "compression_config"):
        if isinstance(cfg.get(key), dict):
            return cfg[key]
    return None


def not_built(cfg: dict[str, Any]) -> str | None:
    """Why a quantized config.json is not built (from the JSON alone, before any import), or None:
    not quantized, or fp8 block-quantized, which the check builds with its quantizer."""
    if isinstance(cfg.get("compression_config"), dict):
        return ("a compressed-tensors checkpoint (compression_config): its layers exist only once that quantizer "
                f"replaces them; {ONLY}")
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = method_name(q)
    if method != BUILT_METHOD:
        return (f"a checkpoint quantized with {method}: its layers exist only once the {method} quantizer replaces "
                f"them; {ONLY}")
    got = {k: q.get(k, v) for k, v in FP8_DEFAULTS}
    block = got["weight_block_size"]
    if block is None:
        return f"an fp8 checkpoint with per-tensor scales (weight_block_size null); {ONLY}"
    if got["scale_fmt"] != "float":
        return f"an fp8 checkpoint with {got['scale_fmt']!r} scales (scale_fmt); {ONLY} with float scales"
    if got["expert_dtype"] != "fp8":
        return f"an fp8 checkpoint with {got['expert_dtype']!r} experts (expert_dtype); {ONLY}"
    if got["dequantize"] is not False:
        return "an fp8 checkpoint whose quantization_config asks transformers to dequantize on load; " + ONLY
    if q.get("modules_to_convert"):
        return f"an fp8 checkpoint with fp8 embeddings (modules_to_convert); {ONLY} of Linear layers"
    return None


def make_quantizer(config: Any) -> Any:
    """The quantizer ``from_pretrained`` makes for ``config`` (its ``quantization_config`` still
    config.json's dict), in its quantized form; ``config.quantization_config`` becomes the
    quantizer's config object, as ``get_hf_quantizer`` leaves it. :class:`NotChecked` when the
    installed transformers lacks the API or the quantizer refuses this environment."""
    try:
        from transformers.quantizers.auto import AutoHfQuantizer, get_hf_quantizer
    except ImportError as exc:  # an API a later transformers may move: a note, never a traceback
        raise NotChecked(f"the installed transformers has no quantizer API this check uses ({exc})") from None
    raw = config.quantization_config
    method = method_name(raw) if isinstance(raw, dict) else "?"
    quantizer = AutoHfQuantizer.from_config(copy.deepcopy(raw), pre_quantized=True)  # a bad config: the build fails
    # from_pretrained's call: its creation, merge and validate_environment, on a copy (it may switch to dequantizing)
    try:
        args = inspect.signature(get_hf_quantizer).bind(copy.deepcopy(config), None, None, True, {})
    except TypeError:
        raise NotChecked("the installed transformers' get_hf_quantizer takes other arguments than this check "
                         "passes") from None
    try:
        probe, _, _ = get_hf_quantizer(*args.args, **args.kwargs)
    except Exception as exc:  # noqa: BLE001 -- the quantizer's own refusal is the note's reason
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise NotChecked(f"transformers' {method} quantizer refuses this environment: {type(exc).__name__}: "
                         f"{first}") from None
    if probe is None:
        raise NotChecked(f"the installed transformers does not support quant_method {method!r}")
    config.quantization_config = quantizer.quantization_config
    return quantizer


def quantize_meta(quantizer: Any, model: Any, dtype: Any) -> None:
    """``preprocess_model`` as ``from_pretrained`` calls it, inside the init context: the layers
    become the quantizer's (meta device, no weight memory)."""
    quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)


def scale_words(out: Outcome) -> None:
    """What transformers does with missing or mis-shaped fp8 scales, in the outcome's messages: the
    fp8 layers' loader, and the dequantizing one a machine without a suitable GPU falls back to."""
    if any(k.endswith("scale_inv") for k in out.missing):
        out.on_missing = ("initialises them and warns (MISSING in its LOAD REPORT; a weight_scale_inv is left as "
                          "allocated, garbage, and without a GPU, where it dequantizes on load, its weight is loaded "
                          "unscaled and nothing is reported)")
    if any(k.endswith("scale_inv") for k, _, _ in out.mismatched):
        out.on_mismatch = ("raises (\"ignore_mismatched_sizes\" is False by default; for a weight_scale_inv, where it "
                           "loads fp8 layers: without a GPU it dequantizes with the block size of the stored grid "
                           "instead, and raises only where that grid does not divide its weight)")
