"""``verify``: static agreement between config.json / adapter_config.json and the tensors.

Pure functions over tensor metadata (name, dtype, shape); no file access, no torch. The model
layouts understood are the decoder-only families transformers writes:

* Llama-style names (Llama, Mistral, Mixtral, Qwen2/3, Gemma 1-3, Phi-3, most VLM text towers):
  ``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
  ``lm_head``;
* GPT-2 (``transformer.wte/wpe``, ``h.{i}.attn.c_attn``; Conv1D weights are stored [in, out]);
* GPT-NeoX (``gpt_neox.embed_in``, ``layers.{i}.attention.query_key_value``, ``embed_out``);
* Falcon / Bloom (``transformer.word_embeddings``, ``h.{i}.self_attention.query_key_value``).

The layout is recognised from the tensor names (not from ``model_type``) and the prefix in front
of the embedding (``model.``, ``model.language_model.``, none) is found, so bare base models and
multimodal checkpoints work too. Shapes are checked only where a tensor exists; quantized and
encoder-decoder checkpoints are skipped with an info finding.

PEFT rules follow peft's own matching (``check_target_module_exists``, ``get_pattern_key``,
``get_peft_model_state_dict``): ``target_modules`` as a string is a regex fullmatch, as a list an
exact name or a ``.name`` suffix, with ``exclude_modules``, ``layers_to_transform`` and
``layers_pattern``; ``rank_pattern`` keys match ``(.*\\.)?key$``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format import dtypes as dt


@dataclass(frozen=True)
class TensorMeta:
    """What verify knows about a tensor without reading its data."""

    name: str
    dtype: str | None  # safetensors dtype name; None when unknown
    shape: tuple[int, ...]
    file: str

    @property
    def numel(self) -> int:
        return dt.numel(self.shape)


FLOATS = frozenset({"F16", "BF16", "F32", "F64"})
QUANT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3",
                          "F6_E3M2"})
QUANT_SUFFIXES = (".qweight", ".qzeros", ".absmax", ".quant_map", ".quant_state", ".weight_scale",
                  ".weight_scale_inv", ".weight_packed", ".SCB", ".weight_zero_point", ".input_scale",
                  ".nested_absmax", ".g_idx")
CONFIG_DTYPES = {"float32": "F32", "float": "F32", "float16": "F16", "half": "F16", "bfloat16": "BF16",
                 "float64": "F64", "double": "F64"}
GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")

_FIX_CONFIG = "fix config.json (or re-export the checkpoint from the model that produced it)"


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _Cfg:
    """Field lookup across a config and its nested ``text_config`` (multimodal models)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.top = cfg
        tc = cfg.get("text_config")
        self.text: dict[str, Any] = tc if isinstance(tc, dict) else {}

    def get(self, *names: str) -> Any:
        for src in (self.text, self.top):
            for n in names:
                v = src.get(n)
                if v is not None:
                    return v
        return None

    def first_top(self, *names: str) -> Any:
        for src in (self.top, self.text):
            for n in names:
                if n in src:
                    return src[n]
        return None


@dataclass
class Dims:
    hidden: int | None = None
    heads: int | None = None
    kv: int | None = None
    head_dim: int | None = None
    inter: int | None = None
    vocab: int | None = None
    layers: int | None = None
    max_pos: int | None = None


@dataclass(frozen=True)
class Rule:
    suffix: str  # tensor name inside a layer, e.g. "self_attn.q_proj.weight"
    shape: Callable[[Dims], tuple[int | None, ...] | None]
    code: str
    what: str  # which config fields decide the shape


@dataclass(frozen=True)
class Spec:
    name: str
    embed: str
    layer: str  # "layers" or "h"
    lm_head: str
    rules: tuple[Rule, ...]
    position: str | None = None
    dims: Callable[[_Cfg], Dims] | None = None


def _mul(*xs: int | None) -> int | None:
    out = 1
    for x in xs:
        if x is None:
            return None
        out *= x
    return out


def _llama_dims(c: _Cfg) -> Dims:
    d = Dims(hidden=_int(c.get("hidden_size", "n_embd", "d_model")),
             heads=_int(c.get("num_attention_heads", "n_head", "num_heads")),
             inter=_int(c.get("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim")),
             vocab=_int(c.get("vocab_size")),
             layers=_int(c.get("num_hidden_layers", "n_layer", "num_layers")),
             max_pos=_int(c.get("max_position_embeddings", "n_positions")))
    d.kv = _int(c.get("num_key_value_heads")) or d.heads
    d.head_dim = _int(c.get("head_dim"))
    if d.head_dim is None and d.hidden and d.heads:
        d.head_dim = d.hidden // d.heads
    return d


def _gpt2_dims(c: _Cfg) -> Dims:
    d = _llama_dims(c)
    if d.inter is None and d.hidden:
        d.inter = 4 * d.hidden
    d.kv = d.heads
    return d


def _falcon_dims(c: _Cfg) -> Dims:
    d = _llama_dims(c)
    if _int(c.get("ffn_hidden_size")):
        d.inter = _int(c.get("ffn_hidden_size"))
    elif d.inter is None and d.hidden:
        d.inter = 4 * d.hidden
    if d.hidden and d.heads:
        d.head_dim = d.hidden // d.heads
    if c.get("new_decoder_architecture"):
        d.kv = _int(c.get("num_kv_heads")) or d.heads
    elif c.get("multi_query"):
        d.kv = 1
    else:
        d.kv = d.heads
    return d


_ATT = "config.attention_shape"
_KV = "config.kv_heads_mismatch"
_MLP = "config.mlp_shape"
_Q_WHAT = "num_attention_heads x head_dim by hidden_size"
_KV_WHAT = "num_key_value_heads x head_dim by hidden_size"

LLAMA = Spec("llama-style", "embed_tokens.weight", "layers", "lm_head.weight", (
    Rule("self_attn.q_proj.weight", lambda d: (_mul(d.heads, d.head_dim), d.hidden), _ATT, _Q_WHAT),
    Rule("self_attn.k_proj.weight", lambda d: (_mul(d.kv, d.head_dim), d.hidden), _KV, _KV_WHAT),
    Rule("self_attn.v_proj.weight", lambda d: (_mul(d.kv, d.head_dim), d.hidden), _KV, _KV_WHAT),
    Rule("self_attn.o_proj.weight", lambda d: (d.hidden, _mul(d.heads, d.head_dim)), _ATT,
         "hidden_size by num_attention_heads x head_dim"),
    Rule("self_attn.q_proj.bias", lambda d: (_mul(d.heads, d.head_dim),), _ATT, "num_attention_heads x head_dim"),
    Rule("self_attn.k_proj.bias", lambda d: (_mul(d.kv, d.head_dim),), _KV, "num_key_value_heads x head_dim"),
    Rule("self_attn.v_proj.bias", lambda d: (_mul(d.kv, d.head_dim),), _KV, "num_key_value_heads x head_dim"),
    Rule("self_attn.qkv_proj.weight",
         lambda d: (None if d.heads is None or d.kv is None or d.head_dim is None
                    else (d.heads + 2 * d.kv) * d.head_dim, d.hidden), _ATT,
         "(num_attention_heads + 2 x num_key_value_heads) x head_dim by hidden_size"),
    Rule("mlp.gate_proj.weight", lambda d: (d.inter, d.hidden), _MLP, "intermediate_size by hidden_size"),
    Rule("mlp.up_proj.weight", lambda d: (d.inter, d.hidden), _MLP, "intermediate_size by hidden_size"),
    Rule("mlp.down_proj.weight", lambda d: (d.hidden, d.inter), _MLP, "hidden_size by intermediate_size"),
    Rule("mlp.gate_up_proj.weight", lambda d: (_mul(2, d.inter), d.hidden), _MLP,
         "2 x intermediate_size by hidden_size"),
), dims=_llama_dims)

GPT2 = Spec("gpt2", "wte.weight", "h", "lm_head.weight", (
    Rule("attn.c_attn.weight", lambda d: (d.hidden, _mul(3, d.hidden)), _ATT, "n_embd by 3 x n_embd (Conv1D)"),
    Rule("attn.c_proj.weight", lambda d: (d.hidden, d.hidden), _ATT, "n_embd by n_embd"),
    Rule("mlp.c_fc.weight", lambda d: (d.hidden, d.inter), _MLP, "n_embd by n_inner (default 4 x n_embd)"),
    Rule("mlp.c_proj.weight", lambda d: (d.inter, d.hidden), _MLP, "n_inner by n_embd"),
), position="wpe.weight", dims=_gpt2_dims)

NEOX = Spec("gpt-neox", "embed_in.weight", "layers", "embed_out.weight", (
    Rule("attention.query_key_value.weight", lambda d: (_mul(3, d.heads, d.head_dim), d.hidden), _ATT,
         "3 x num_attention_heads x head_dim by hidden_size"),
    Rule("attention.dense.weight", lambda d: (d.hidden, _mul(d.heads, d.head_dim)), _ATT,
         "hidden_size by num_attention_heads x head_dim"),
    Rule("mlp.dense_h_to_4h.weight", lambda d: (d.inter, d.hidden), _MLP, "intermediate_size by hidden_size"),
    Rule("mlp.dense_4h_to_h.weight", lambda d: (d.hidden, d.inter), _MLP, "hidden_size by intermediate_size"),
), dims=_gpt2_dims)

FALCON = Spec("falcon/bloom", "word_embeddings.weight", "h", "lm_head.weight", (
    Rule("self_attention.query_key_value.weight",
         lambda d: (None if d.heads is None or d.kv is None or d.head_dim is None
                    else (d.heads + 2 * d.kv) * d.head_dim, d.hidden), _ATT,
         "(num_attention_heads + 2 x kv heads) x head_dim by hidden_size (kv heads: num_kv_heads with "
         "new_decoder_architecture, 1 with multi_query)"),
    Rule("self_attention.dense.weight", lambda d: (d.hidden, _mul(d.heads, d.head_dim)), _ATT,
         "hidden_size by hidden_size"),
    Rule("mlp.dense_h_to_4h.weight", lambda d: (d.inter, d.hidden), _MLP, "ffn_hidden_size by hidden_size"),
    Rule("mlp.dense_4h_to_h.weight", lambda d: (d.hidden, d.inter), _MLP, "hidden_size by ffn_hidden_size"),
), dims=_falcon_dims)

SPECS = (LLAMA, GPT2, NEOX, FALCON)


@dataclass
class _Ctx:
    display: str
    findings: list[Finding] = field(default_factory=list)

    def add(self, code: str, severity: str, message: str, hint: str | None = None, tensor: str | None = None,
            **details: Any) -> None:
        self.findings.append(Finding(code, severity, self.display, message, hint, tensor, dict(details)))


def _detect(tensors: dict[str, TensorMeta]) -> tuple[Spec, str] | None:
    """The layout and the prefix in front of its embedding (e.g. ``model.``)."""
    best: tuple[int, Spec, str] | None = None
    names = list(tensors)
    for spec in SPECS:
        roots: set[str] = set()
        for n in names:
            if n == spec.embed or n.endswith("." + spec.embed):
                roots.add(n[: len(n) - len(spec.embed)])
        first = spec.rules[0].suffix
        pat = re.compile(rf"^(.*?){spec.layer}\.\d+\.{re.escape(first)}$")
        for n in names:
            m = pat.match(n)
            if m:
                roots.add(m.group(1))
        for root in roots:
            lp = root + spec.layer + "."
            hits = sum(1 for n in names if n.startswith(lp))
            has_embed = (root + spec.embed) in tensors
            score = hits + (1 << 40 if has_embed else 0)
            if (hits or has_embed) and (best is None or score > best[0]):
                best = (score, spec, root)
    return (best[1], best[2]) if best else None


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if x is None else str(x) for x in shape) + "]"


def _shape_ok(actual: tuple[int, ...], expected: tuple[int | None, ...] | None) -> bool:
    if expected is None or len(actual) != len(expected):
        return expected is None
    return all(e is None or a == e for a, e in zip(actual, expected))


def check_config(display: str, cfg: Any, tensors: dict[str, TensorMeta], *, check_dtype: bool = True,
                 tokenizer_size: int | None = None, tokenizer_display: str | None = None) -> list[Finding]:
    """Findings about config.json (already parsed) against the checkpoint's tensors."""
    ctx = _Ctx(display)
    if not isinstance(cfg, dict):
        ctx.add("config.bad_json", ERROR, f"{display}: top level is a JSON {type(cfg).__name__}, not an object",
                _FIX_CONFIG)
        return ctx.findings
    c = _Cfg(cfg)
    for key in ("architectures", "model_type"):
        if key not in cfg:
            ctx.add("config.missing_field", WARNING, f"{display}: no {key!r} (transformers needs it to pick a class)",
                    _FIX_CONFIG, field=key)
    quantized = isinstance(cfg.get("quantization_config"), dict) or isinstance(cfg.get("compression_config"), dict)
    _check_quantization(ctx, tensors, quantized)
    if check_dtype and not quantized:
        _check_dtype(ctx, c, tensors)
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    if cfg.get("is_encoder_decoder"):
        ctx.add("config.not_checked", INFO, f"{display}: encoder-decoder model; shape checks skipped")
        return ctx.findings
    found = _detect(tensors)
    if found is None:
        ctx.add("config.not_checked", INFO,
                f"{display}: tensor names not recognised (model_type {cfg.get('model_type')!r}); shape checks "
                "skipped", None)
        return ctx.findings
    spec, root = found
    assert spec.dims is not None
    dims = spec.dims(c)
    generative = any(isinstance(a, str) and a.endswith(GENERATIVE) for a in archs) or not archs
    _check_embeddings(ctx, spec, root, dims, tensors, c, generative, quantized)
    _check_layers(ctx, spec, root, dims, tensors, quantized)
    if tokenizer_size is not None and dims.vocab is not None and tokenizer_size > dims.vocab:
        ctx.add("config.tokenizer_vocab", ERROR,
                f"{tokenizer_display or 'tokenizer'} has token ids up to {tokenizer_size - 1}, but vocab_size is "
                f"{dims.vocab}: those tokens index past the embedding",
                "resize the embeddings (model.resize_token_embeddings) and re-export, or fix vocab_size",
                tokenizer_size=tokenizer_size, vocab_size=dims.vocab)
    return ctx.findings


def _check_quantization(ctx: _Ctx, tensors: dict[str, TensorMeta], quantized: bool) -> None:
    signals = [t.name for t in tensors.values()
               if (t.dtype in QUANT_DTYPES and t.name.endswith(".weight"))
               or t.name.endswith(QUANT_SUFFIXES)
               or (t.dtype in ("I8", "U8") and t.name.endswith(".weight") and len(t.shape) == 2)]
    if signals and not quantized:
        ctx.add("config.quantization_missing", WARNING,
                f"{ctx.display}: {len(signals)} tensors look quantized ({signals[0]!r}, ...) but there is no "
                "quantization_config", "copy the quantization_config of the quantized model into config.json",
                tensor=signals[0], count=len(signals))
    elif quantized and not signals:
        ctx.add("config.quantization_unused", WARNING,
                f"{ctx.display}: quantization_config is set but no tensor is quantized",
                "remove quantization_config (the weights are plain floats) or export the quantized weights")


def _check_dtype(ctx: _Ctx, c: _Cfg, tensors: dict[str, TensorMeta]) -> None:
    raw = c.first_top("dtype", "torch_dtype")
    if not isinstance(raw, str) or raw == "auto":
        return
    want = CONFIG_DTYPES.get(raw.removeprefix("torch."))
    if want is None:
        return
    counts: dict[str, int] = {}
    for t in tensors.values():
        if t.dtype in FLOATS:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
    if not counts:
        return
    dominant = max(sorted(counts), key=lambda k: counts[k])
    if dominant != want:
        ctx.add("config.dtype_mismatch", WARNING,
                f"{ctx.display}: dtype is {raw!r} but most parameters are {dominant} "
                f"({counts[dominant]:,} of {sum(counts.values()):,})",
                "set \"dtype\" in config.json to the tensors' dtype, or convert with `ckptctl resave --dtype`",
                config=raw, tensors=dominant)


def _check_embeddings(ctx: _Ctx, spec: Spec, root: str, d: Dims, tensors: dict[str, TensorMeta], c: _Cfg,
                      generative: bool, quantized: bool) -> None:
    layer_prefix = root + spec.layer + "."
    embed = tensors.get(root + spec.embed)
    heads = [t for n, t in tensors.items()
             if (n == spec.lm_head or n.endswith("." + spec.lm_head)) and not n.startswith(layer_prefix)]
    lm = heads[0] if heads else None
    if not quantized:
        for t, role in ((embed, "embedding"), (lm, "lm_head")):
            if t is None or len(t.shape) != 2:
                continue
            if d.vocab is not None and t.shape[0] != d.vocab:
                ctx.add("config.vocab_mismatch", ERROR,
                        f"{role} {t.name!r} has {t.shape[0]} rows but vocab_size is {d.vocab}",
                        "set vocab_size to the embedding rows, or resize the embeddings and re-export",
                        tensor=t.name, rows=t.shape[0], vocab_size=d.vocab)
            if d.hidden is not None and t.shape[1] != d.hidden:
                ctx.add("config.hidden_mismatch", ERROR,
                        f"{role} {t.name!r} has {t.shape[1]} columns but hidden_size is {d.hidden}",
                        _FIX_CONFIG, tensor=t.name, columns=t.shape[1], hidden_size=d.hidden)
        if spec.position:
            pos = tensors.get(root + spec.position)
            if pos is not None and len(pos.shape) == 2 and d.max_pos is not None and pos.shape[0] != d.max_pos:
                ctx.add("config.position_mismatch", ERROR,
                        f"position embedding {pos.name!r} has {pos.shape[0]} rows but the config allows "
                        f"{d.max_pos} positions", _FIX_CONFIG, tensor=pos.name, rows=pos.shape[0],
                        max_positions=d.max_pos)
    bert_pos = next((t for n, t in tensors.items() if n.endswith("embeddings.position_embeddings.weight")), None)
    if bert_pos is not None and d.max_pos is not None and bert_pos.shape and bert_pos.shape[0] != d.max_pos:
        ctx.add("config.position_mismatch", ERROR,
                f"position embedding {bert_pos.name!r} has {bert_pos.shape[0]} rows but max_position_embeddings "
                f"is {d.max_pos}", _FIX_CONFIG, tensor=bert_pos.name)
    tie = c.first_top("tie_word_embeddings")
    if tie is False and lm is None and embed is not None and generative:
        ctx.add("config.lm_head_missing", ERROR,
                f"tie_word_embeddings is false but no {spec.lm_head!r} tensor exists: the output layer would be "
                "randomly initialised", "set tie_word_embeddings to true if the head is tied, or export the "
                "lm_head weights too", tensor=spec.lm_head)
    elif tie is True and lm is not None and embed is not None:
        ctx.add("config.lm_head_tied_present", WARNING,
                f"tie_word_embeddings is true but {lm.name!r} is stored too; transformers ignores it, other "
                "loaders (vLLM) may fail or use it", "set tie_word_embeddings to false if the head is trained "
                "separately, or drop the tensor with `ckptctl resave`", tensor=lm.name)


def _first(items: list[int], total: int, shown: int = 10) -> str:
    """The first ``shown`` items, with ' ...' when there are more (``total`` of them)."""
    return ", ".join(map(str, items[:shown])) + (" ..." if total > shown else "")


def _check_layers(ctx: _Ctx, spec: Spec, root: str, d: Dims, tensors: dict[str, TensorMeta],
                  quantized: bool) -> None:
    pat = re.compile(rf"^{re.escape(root)}{spec.layer}\.(\d+)\.(.+)$")
    present: set[int] = set()
    by_rule: dict[str, list[TensorMeta]] = {}
    suffixes = {r.suffix for r in spec.rules}
    for n, t in tensors.items():
        m = pat.match(n)
        if not m:
            continue
        present.add(int(m.group(1)))
        if m.group(2) in suffixes:
            by_rule.setdefault(m.group(2), []).append(t)
    if d.layers is not None:
        # never materialise range(num_hidden_layers): config.json is untrusted input
        extra = sorted(i for i in present if i >= d.layers)
        n_missing = max(0, d.layers - sum(1 for i in present if i < d.layers))
        missing = []
        i = 0
        while len(missing) < min(n_missing, 200):
            if i not in present:
                missing.append(i)
            i += 1
        where = f"{root}{spec.layer}.N"
        if missing:
            ctx.add("config.layer_missing", ERROR,
                    f"num_hidden_layers is {d.layers} but {n_missing} layers have no tensors under {where} "
                    f"(missing: {_first(missing, n_missing)}); they "
                    "would be randomly initialised", "restore the missing shard(s) or fix num_hidden_layers",
                    missing=missing[:200])
        if extra:
            ctx.add("config.layer_extra", ERROR,
                    f"num_hidden_layers is {d.layers} but tensors exist for layers "
                    f"{_first(extra, len(extra))}; transformers "
                    "silently ignores them", "fix num_hidden_layers, or drop the stale layers with ckptctl resave",
                    extra=extra[:200])
    if quantized:
        ctx.add("config.not_checked", INFO, f"{ctx.display}: quantized checkpoint; projection shapes not checked")
        return
    for rule in spec.rules:
        expected_shape = rule.shape(d)
        bad = [t for t in by_rule.get(rule.suffix, []) if not _shape_ok(t.shape, expected_shape)]
        if not bad or expected_shape is None:
            continue
        shapes = sorted({_fmt(t.shape) for t in bad})
        ctx.add(rule.code, ERROR,
                f"{len(bad)} tensors {root}{spec.layer}.N.{rule.suffix} have shape {', '.join(shapes)}; the config "
                f"({rule.what}) says {_fmt(expected_shape)}", _FIX_CONFIG, tensor=bad[0].name,
                expected=list(expected_shape), actual=[list(t.shape) for t in bad[:5]], count=len(bad))


# --------------------------------------------------------------------------------------------
# PEFT

_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")
_LORA_PARAM = re.compile(r"^(?P<module>.+)\.(?P<part>lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                         r"(?:\.(?P<adapter>[^.]+))?$")
EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")
_FIX_ADAPTER = "fix adapter_config.json, or save the adapter again with peft"


def _valid_match(key: str, target: str) -> bool:
    return key == target or key.endswith("." + target)


def _user_patterns(acfg: dict[str, Any]) -> list[str]:
    """Every regex adapter_config.json hands to ``re``, as peft builds them."""
    out: list[str] = []
    for k in ("target_modules", "exclude_modules"):
        if isinstance(acfg.get(k), str):
            out.append(acfg[k])
    lp = acfg.get("layers_pattern")
    for p in [lp] if isinstance(lp, str) else lp if isinstance(lp, list) else []:
        out.append(rf".*\.{p}\.(\d+)\.")
    for k in ("rank_pattern", "alpha_pattern"):
        if isinstance(acfg.get(k), dict):
            out.extend(rf"(.*\.)?({p})$" for p in acfg[k])
    return out


def _config_field_problem(acfg: dict[str, Any]) -> str | None:
    """Why adapter_config.json's matching fields cannot be used as peft uses them, or None."""
    def str_or_strs(v: Any) -> bool:
        return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))

    for k in ("exclude_modules", "layers_pattern", "modules_to_save"):
        if not str_or_strs(acfg.get(k)):
            return f"{k!r} is {acfg.get(k)!r}, not a string or a list of strings"
    layers = acfg.get("layers_to_transform")
    if not (layers is None or (isinstance(layers, int) and not isinstance(layers, bool))
            or (isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers))):
        return f"'layers_to_transform' is {layers!r}, not an integer or a list of integers"
    for k in ("rank_pattern", "alpha_pattern"):
        v = acfg.get(k)
        if v is not None and not (isinstance(v, dict) and all(isinstance(x, str) for x in v)):
            return f"{k!r} is {v!r}, not an object with pattern keys"
    for p in _user_patterns(acfg):
        try:
            re.compile(p)
        except re.error as exc:
            return f"invalid regex {p!r} ({exc})"
    return None


# A quantified group whose body is itself quantified: (a+)+, (\w+\.?\w*)*, (x{2,})+ ...
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*(?:[+*]|\{\d*,?\d*\})(?:[^()\\]|\\.)*\)(?:[+*]|\{\d*,\d*\})")


def _backtracking_risk(pattern: str) -> bool:
    return bool(_NESTED_QUANTIFIER.search(pattern))


def peft_target_match(acfg: dict[str, Any], key: str) -> bool:
    """peft's ``check_target_module_exists`` for a module name of the base model."""
    excl = acfg.get("exclude_modules")
    if excl:
        if isinstance(excl, str):
            if re.fullmatch(excl, key):
                return False
        elif key in excl or any(key.endswith(f".{e}") for e in excl):
            return False
    tm = acfg.get("target_modules")
    if isinstance(tm, str):
        return tm == "all-linear" or re.fullmatch(tm, key) is not None
    if not isinstance(tm, list):
        return False
    if key in tm:
        return True
    found = any(key.endswith(f".{t}") for t in tm if isinstance(t, str))
    layers = acfg.get("layers_to_transform")
    pattern = acfg.get("layers_pattern")
    using = layers is not None and (len(layers) != 0 if isinstance(layers, list) else True)
    if using and found:
        idx = None
        if not pattern:
            idx = re.match(r".*\.[^.]*\.(\d+)\.", key)
        else:
            for p in [pattern] if isinstance(pattern, str) else pattern:
                idx = re.match(rf".*\.{p}\.(\d+)\.", key)
                if idx is not None:
                    break
        if idx is None:
            return False
        i = int(idx.group(1))
        return i == layers if isinstance(layers, int) else i in layers
    return found


def peft_rank(acfg: dict[str, Any], key: str) -> int | None:
    """The rank peft gives a module: ``rank_pattern`` (``(.*\\.)?pattern$``) else ``r``."""
    rp = acfg.get("rank_pattern") or {}
    if isinstance(rp, dict):
        for pattern, r in rp.items():
            if re.match(rf"(.*\.)?({pattern})$", key):
                return _int(r)
    return _int(acfg.get("r"))


@dataclass
class _Module:
    parts: dict[str, TensorMeta] = field(default_factory=dict)  # lora_A, lora_B, lora_embedding_A, ...


def check_adapter(display: str, acfg: Any, tensors: dict[str, TensorMeta], *,
                  base: dict[str, TensorMeta] | None = None, base_label: str | None = None) -> list[Finding]:
    """Findings about adapter_config.json against the adapter's tensors (and the base model's, if known)."""
    ctx = _Ctx(display)
    if not isinstance(acfg, dict):
        ctx.add("adapter.bad_config", ERROR, f"{display}: top level is not a JSON object", _FIX_ADAPTER)
        return ctx.findings
    peft_type = acfg.get("peft_type")
    if not isinstance(peft_type, str):
        ctx.add("adapter.missing_field", ERROR, f"{display}: no 'peft_type' (peft cannot load the adapter)",
                _FIX_ADAPTER, field="peft_type")
        return ctx.findings
    if not tensors:
        ctx.add("adapter.empty", ERROR, f"{display}: the adapter weights file holds no tensors",
                "save the adapter again with peft")
        return ctx.findings
    if peft_type != "LORA":
        ctx.add("adapter.not_checked", INFO, f"{display}: peft_type {peft_type!r}: only LoRA adapters are "
                "checked in depth")
        return ctx.findings
    for key in ("lora_alpha", "base_model_name_or_path"):
        if acfg.get(key) is None:
            ctx.add("adapter.missing_optional", WARNING, f"{display}: no {key!r} (peft falls back to a default)",
                    _FIX_ADAPTER, field=key)
    r = _int(acfg.get("r"))
    if r is None or r <= 0:
        ctx.add("adapter.missing_field", ERROR, f"{display}: 'r' is {acfg.get('r')!r}, not a positive integer",
                _FIX_ADAPTER, field="r")
        return ctx.findings
    tm = acfg.get("target_modules")
    if tm is None and acfg.get("target_parameters"):
        ctx.add("adapter.not_checked", INFO, f"{display}: adapter uses target_parameters; module matching skipped")
        return ctx.findings
    if not isinstance(tm, (str, list)):
        ctx.add("adapter.missing_field", ERROR, f"{display}: 'target_modules' is {tm!r}, not a list or regex",
                _FIX_ADAPTER, field="target_modules")
        return ctx.findings
    problem = _config_field_problem(acfg)
    if problem:
        ctx.add("adapter.bad_config", ERROR, f"{display}: {problem}", _FIX_ADAPTER)
        return ctx.findings
    risky = [p for p in _user_patterns(acfg) if _backtracking_risk(p)]
    if risky:
        ctx.add("adapter.regex_not_checked", WARNING,
                f"{display}: pattern {risky[0]!r} nests quantifiers (it can take exponential time); module "
                "matching was skipped", "peft may hang on it too: write the pattern without nested repetition")
        return ctx.findings

    modules: dict[str, _Module] = {}
    bad_prefix: list[str] = []
    named: list[str] = []
    unexpected: list[str] = []
    mts = acfg.get("modules_to_save") or []
    bias_mode = acfg.get("bias", "none")
    for name, t in tensors.items():
        if not name.startswith(_PREFIX):
            bad_prefix.append(name)
            continue
        rel = name[len(_PREFIX):]
        m = _LORA_KEY.match(rel) or _LORA_PARAM.match(rel)
        if m:
            adapter = m.group("adapter")
            part = m.group("part")
            if adapter == "weight" and part == "lora_magnitude_vector":
                adapter = None
            if adapter is not None:
                named.append(name)
                continue
            if m.re is _LORA_KEY and m.group("param") == "bias":
                if part == "lora_B" and acfg.get("lora_bias"):
                    continue
                unexpected.append(name)
                continue
            modules.setdefault(m.group("module"), _Module()).parts[part] = t
            continue
        module = rel.rsplit(".", 1)[0] if "." in rel else rel
        if any(_valid_match(module, x) for x in mts if isinstance(x, str)):
            continue
        if rel.endswith(".bias") and bias_mode in ("all", "lora_only"):
            continue
        if module.split(".")[-1] in EMBEDDING_LAYER_NAMES:
            continue  # save_embedding_layers: resized embeddings are saved whole
        unexpected.append(name)
    if bad_prefix:
        ctx.add("adapter.bad_prefix", ERROR,
                f"{len(bad_prefix)} adapter keys do not start with {_PREFIX!r} ({bad_prefix[0]!r}, ...): peft will "
                "not find them", "save the adapter with peft's save_pretrained (it adds the prefix)",
                tensor=bad_prefix[0], keys=bad_prefix[:50])
    if named:
        ctx.add("adapter.adapter_name_in_key", ERROR,
                f"{len(named)} adapter keys still contain the adapter name ({named[0]!r}, ...): peft inserts it on "
                "load, so these keys never match", "save with peft's save_pretrained (it removes the adapter name)",
                tensor=named[0], keys=named[:50])
    if unexpected:
        ctx.add("adapter.unexpected_key", WARNING,
                f"{len(unexpected)} keys are neither LoRA weights nor modules_to_save ({unexpected[0]!r}, ...); peft "
                "ignores them", "list the module in modules_to_save, or drop the keys", tensor=unexpected[0],
                keys=unexpected[:50])

    untargeted = [mod for mod in modules if not peft_target_match(acfg, mod)]
    if untargeted:
        first = untargeted[0]
        ctx.add("adapter.untargeted_key", ERROR,
                f"{len(untargeted)} LoRA modules are not matched by target_modules={tm!r} ({first!r}, ...): peft "
                "creates no LoRA layer there and drops their weights",
                "add the modules to target_modules (peft matches list entries by exact name or '.name' suffix, "
                "a string as a full regex)", tensor=_PREFIX + first, modules=untargeted[:50])
    _check_lora_shapes(ctx, acfg, modules, r)
    if base is not None:
        _check_against_base(ctx, acfg, modules, base, base_label or "base model")
    return ctx.findings


def _check_lora_shapes(ctx: _Ctx, acfg: dict[str, Any], modules: dict[str, _Module], r: int) -> None:
    unpaired: list[str] = []
    rank_bad: list[tuple[str, int, int | None]] = []
    dora_missing: list[str] = []
    use_dora = bool(acfg.get("use_dora"))
    for mod, info in modules.items():
        p = info.parts
        if "lora_A" in p or "lora_B" in p:
            a_key, b_key, emb = "lora_A", "lora_B", False
        elif "lora_embedding_A" in p or "lora_embedding_B" in p:
            a_key, b_key, emb = "lora_embedding_A", "lora_embedding_B", True
        else:
            continue  # only a magnitude vector: reported as unpaired below
        if a_key not in p or b_key not in p:
            unpaired.append(_PREFIX + mod)
            continue
        want = peft_rank(acfg, mod) or r
        a, b = p[a_key], p[b_key]
        got_a = a.shape[0] if a.shape else None
        got_b = b.shape[1] if len(b.shape) >= 2 else None
        if got_a != want or got_b != want:
            rank_bad.append((a.name, want, got_a if got_a != want else got_b))
        if use_dora and not emb and "lora_magnitude_vector" not in p:
            dora_missing.append(_PREFIX + mod)
    for mod, info in modules.items():
        if set(info.parts) == {"lora_magnitude_vector"}:
            unpaired.append(_PREFIX + mod)
    if unpaired:
        ctx.add("adapter.pair_missing", ERROR,
                f"{len(unpaired)} LoRA modules lack their A or B matrix ({unpaired[0]!r}, ...); peft reports them as "
                "missing adapter keys and leaves them at their initial values",
                "save the adapter again; the file is incomplete", tensor=unpaired[0], modules=unpaired[:50])
    if rank_bad:
        name, want, got = rank_bad[0]
        ctx.add("adapter.rank_mismatch", ERROR,
                f"{len(rank_bad)} LoRA modules have rank {got} but adapter_config.json gives r={want} "
                f"({name!r}, ...); peft fails with a size mismatch",
                "set r (or rank_pattern) to the rank the tensors were trained with", tensor=name,
                expected=want, actual=got, count=len(rank_bad))
    if dora_missing:
        ctx.add("adapter.dora_magnitude_missing", ERROR,
                f"use_dora is true but {len(dora_missing)} LoRA modules have no lora_magnitude_vector "
                f"({dora_missing[0]!r}, ...)", "save the DoRA adapter again with peft, or set use_dora to false",
                tensor=dora_missing[0], modules=dora_missing[:50])


def _check_against_base(ctx: _Ctx, acfg: dict[str, Any], modules: dict[str, _Module],
                        base: dict[str, TensorMeta], label: str) -> None:
    absent: list[str] = []
    shape_bad: list[tuple[str, str]] = []
    fan_in_fan_out = bool(acfg.get("fan_in_fan_out"))
    for mod, info in modules.items():
        w = base.get(mod + ".weight")
        if w is None:
            absent.append(mod)
            continue
        p = info.parts
        if "lora_A" in p and "lora_B" in p and len(w.shape) >= 2:
            out_f, in_f = (w.shape[1], w.shape[0]) if fan_in_fan_out else (w.shape[0], w.shape[1])
            a, b = p["lora_A"], p["lora_B"]
            if len(a.shape) < 2 or a.shape[1] != in_f or not b.shape or b.shape[0] != out_f:
                shape_bad.append((a.name, f"lora_A {list(a.shape)} / lora_B {list(b.shape)} vs base {list(w.shape)}"))
        elif "lora_embedding_A" in p and "lora_embedding_B" in p and len(w.shape) == 2:
            a, b = p["lora_embedding_A"], p["lora_embedding_B"]
            if len(a.shape) != 2 or a.shape[1] != w.shape[0] or not b.shape or b.shape[0] != w.shape[1]:
                shape_bad.append((a.name, f"lora_embedding_A {list(a.shape)} / lora_embedding_B {list(b.shape)} "
                                  f"vs base {list(w.shape)}"))
    if absent:
        ctx.add("adapter.module_not_in_base", ERROR,
                f"{len(absent)} LoRA modules do not exist in the {label} ({absent[0]!r}, ...)",
                "check base_model_name_or_path: the adapter was trained on another model", tensor=_PREFIX + absent[0],
                modules=absent[:50])
    if shape_bad:
        ctx.add("adapter.shape_mismatch", ERROR,
                f"{len(shape_bad)} LoRA modules do not fit the {label}: {shape_bad[0][1]} ({shape_bad[0][0]!r}, ...)",
                "check base_model_name_or_path (and fan_in_fan_out): the adapter was trained on another model",
                tensor=shape_bad[0][0], count=len(shape_bad))
    tm = acfg.get("target_modules")
    if tm == "all-linear" or tm is None:
        return
    wanted = sorted({n[: -len(".weight")] for n, t in base.items() if n.endswith(".weight") and len(t.shape) >= 2
                     and peft_target_match(acfg, n[: -len(".weight")])})
    missing = [m for m in wanted if m not in modules]
    if missing:
        ctx.add("adapter.missing_keys", ERROR,
                f"target_modules matches {len(wanted)} modules of the {label} but the adapter has no weights for "
                f"{len(missing)} of them ({missing[0]!r}, ...); peft warns 'Found missing adapter keys' and leaves "
                "them untrained", "save the adapter again (the file is incomplete), or narrow target_modules",
                tensor=_PREFIX + missing[0], modules=missing[:50], count=len(missing))
