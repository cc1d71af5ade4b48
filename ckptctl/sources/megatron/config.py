"""The Hugging Face ``config.json`` of a Megatron GPT checkpoint, from the run's arguments.

Megatron-LM pickles its argument namespace into ``common.pt`` (field names of Megatron-LM
0.16.1: ``num_layers``, ``hidden_size``, ``num_query_groups``, ``norm_epsilon``,
``padded_vocab_size`` ...). :func:`describe` picks the family (a mixture of experts is
Mixtral-style, a QKV bias Qwen2-style, else Llama-style), refuses with the argument named what
no mapping covers (LayerNorm, a non-gated MLP, linear biases, QK norms, rotary scaling, shared
experts ...), and gives the sizes the mapping needs and the config transformers reads. The
tensors are checked against these sizes by the mapping itself (``megatron_mapping.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptctl.sources.megatron.mapping import FAMILIES, Dims, Family


class ArgsError(ValueError):
    """What the arguments say that no mapping covers, or that contradicts itself."""


@dataclass(frozen=True)
class Described:
    family: Family
    dims: Dims
    config: dict[str, Any]


def _get(args: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if args.get(n) is not None:
            return args[n]
    return default


def _int(args: dict[str, Any], name: str, *alts: str, default: int | None = None) -> int:
    v = _get(args, name, *alts, default=default)
    if type(v) is not int or v <= 0:
        raise ArgsError(f"argument {name} is {v!r}, not a positive integer")
    return v


def _float(args: dict[str, Any], *names: str, default: float) -> float:
    v = _get(args, *names, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ArgsError(f"argument {names[0]} is {v!r}, not a number")
    return float(v)


_UNCOVERED = (  # (argument, the value a mapping covers, what it would be)
    ("normalization", "RMSNorm", "LayerNorm: no RMSNorm-based HF family matches"),
    ("swiglu", True, "a non-gated MLP"),
    ("position_embedding_type", "rope", "position embeddings other than rotary"),
    ("add_bias_linear", False, "biases on the linear layers"),
    ("qk_layernorm", False, "query/key norms"),
    ("apply_layernorm_1p", False, "zero-centred (1p) norm weights"),
    ("multi_latent_attention", False, "multi-latent attention"),
    ("use_rope_scaling", False, "rotary scaling"),
    ("moe_router_pre_softmax", False, "a softmax before the top-k choice"),
)


def describe(args: dict[str, Any], dtype: str | None) -> Described:
    """Family, sizes and ``config.json`` of the model ``args`` describe (``dtype``: the config
    name of the weights' dtype). Raises ArgsError."""
    for name, covered, what in _UNCOVERED:
        value = args.get(name)
        if value is None and name in ("swiglu", "normalization", "position_embedding_type"):
            raise ArgsError(f"argument {name} is not recorded")
        if value is not None and value != covered:
            raise ArgsError(f"{name}={value!r} ({what}) is not covered by the Llama, Qwen2 or Mixtral mappings")
    if _float(args, "rotary_percent", default=1.0) != 1.0:
        raise ArgsError(f"rotary_percent={args['rotary_percent']!r} (partial rotary) is not covered")
    layers = _int(args, "num_layers")
    hidden = _int(args, "hidden_size")
    heads = _int(args, "num_attention_heads")
    groups = _int(args, "num_query_groups", default=heads) if args.get("group_query_attention") else heads
    head_dim = _int(args, "kv_channels", default=hidden // heads)
    if heads % groups:
        raise ArgsError(f"{heads} attention heads do not divide into {groups} query groups")
    experts = _int(args, "num_experts") if _get(args, "num_experts") else 0
    if experts and _get(args, "moe_shared_expert_intermediate_size"):
        raise ArgsError("moe_shared_expert_intermediate_size (shared experts) is not covered by the Mixtral mapping")
    if experts and _get(args, "moe_layer_freq", default=1) != 1:
        raise ArgsError(f"moe_layer_freq={args['moe_layer_freq']!r} (dense layers between MoE layers) is not covered")
    if experts and _get(args, "moe_router_score_function", default="softmax") != "softmax":
        raise ArgsError(f"moe_router_score_function={args['moe_router_score_function']!r} is not covered")
    ffn = _int(args, "moe_ffn_hidden_size", "ffn_hidden_size") if experts else _int(args, "ffn_hidden_size")
    padded = _int(args, "padded_vocab_size", "vocab_size")
    vocab = _get(args, "vocab_size", default=None) or padded
    if type(vocab) is not int or not 0 < vocab <= padded:
        raise ArgsError(f"vocab_size={vocab!r} does not fit padded_vocab_size={padded}")
    tied = not bool(args.get("untie_embeddings_and_output_weights", False))
    qkv_bias = bool(args.get("add_qkv_bias", False))
    if experts and qkv_bias:
        raise ArgsError("a mixture of experts with a QKV bias (Qwen2-MoE) is not covered")
    fam = FAMILIES["mixtral" if experts else "qwen2" if qkv_bias else "llama"]
    theta = _float(args, "rotary_base", default=10000)
    eps = _float(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)
    cfg: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": fam.name, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": groups, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": _int(args, "max_position_embeddings", "seq_length", default=4096),
        "rms_norm_eps": eps, "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": tied, "attention_dropout": 0.0, "use_cache": True,
    }
    if fam.name == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if fam.name == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None)
    if experts:
        cfg.update(num_local_experts=experts, num_experts_per_tok=_int(args, "moe_router_topk", default=2),
                   router_aux_loss_coef=_float(args, "moe_aux_loss_coeff", default=0.0), sliding_window=None)
    if dtype:
        cfg["dtype"] = dtype
    dims = Dims(layers, heads, groups, head_dim, ffn, vocab, experts, tied)
    return Described(fam, dims, dict(sorted(cfg.items())))


def summary(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments inspect shows (those that decide the architecture), as recorded."""
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
            "num_query_groups", "kv_channels", "normalization", "norm_epsilon", "layernorm_epsilon", "swiglu",
            "position_embedding_type", "rotary_base", "rotary_percent", "add_bias_linear", "add_qkv_bias",
            "untie_embeddings_and_output_weights", "vocab_size", "padded_vocab_size", "num_experts",
            "moe_router_topk", "moe_ffn_hidden_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "expert_model_parallel_size", "transformer_impl", "ckpt_format", "bf16", "fp16", "params_dtype")
    return {k: args[k] for k in keys if k in args}
