"""The Hugging Face ``config.json`` of a Megatron GPT checkpoint, from the run's arguments.

Megatron-LM pickles its argument namespace into ``common.pt`` (field names of Megatron-LM
0.16.1: ``num_layers``, ``hidden_size``, ``num_query_groups``, ``norm_epsilon``,
``padded_vocab_size`` ...). :func:`describe` picks the family (a mixture of experts is
Qwen3-MoE-style with QK norms, else Mixtral-style; QK norms Qwen3-style, a QKV bias
Qwen2-style, else Llama-style), the vocabulary the run's tokenizer had (:func:`vocabulary`), refuses with the argument named what
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


class OptionError(ArgsError):
    """An export option (``--vocab-size``) that does not fit the checkpoint."""


@dataclass(frozen=True)
class Described:
    family: Family
    dims: Dims
    config: dict[str, Any]
    note: str | None = None  # what the export should say (a vocabulary kept padded)


def _get(args: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if args.get(n) is not None:
            return args[n]
    return default


# Counts a model's description may give before any tensor is compared (they size loops and
# lists): a stranger's common.pt or run_config.yaml must not make them unbounded.
MAX_COUNT = 1 << 16  # layers, experts, heads
MAX_SIZE = 1 << 31  # any other size (hidden, vocabulary, FFN)


def bounded(name: str, v: int) -> int:
    """``v``, or ArgsError when it is past what any model has (:data:`MAX_COUNT` for a count)."""
    limit = MAX_COUNT if any(w in name for w in ("layers", "experts", "heads", "groups")) else MAX_SIZE
    if v > limit:
        raise ArgsError(f"{name} is {v:,}, more than any model has (at most {limit:,}): not a real checkpoint's")
    return v


def _int(args: dict[str, Any], name: str, *alts: str, default: int | None = None) -> int:
    v = _get(args, name, *alts, default=default)
    if type(v) is not int or v <= 0:
        raise ArgsError(f"argument {name} is {v!r}, not a positive integer")
    return bounded(name, v)


def _float(args: dict[str, Any], *names: str, default: float) -> float:
    v = _get(args, *names, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ArgsError(f"argument {names[0]} is {v!r}, not a number")
    return float(v)


_UNCOVERED = (  # (argument, the value a mapping covers, what it would be)
    ("multi_latent_attention", False, "multi-latent attention (MLA)"),
    ("normalization", "RMSNorm", "LayerNorm: no RMSNorm-based HF family matches"),
    ("swiglu", True, "a non-gated MLP"),
    ("position_embedding_type", "rope", "position embeddings other than rotary"),
    ("add_bias_linear", False, "biases on the linear layers"),
    ("apply_layernorm_1p", False, "zero-centred (1p) norm weights"),
    ("use_rope_scaling", False, "rotary scaling"),
    ("moe_router_pre_softmax", False, "a softmax before the top-k choice"),
)
# Megatron-LM's tokenizers whose vocabulary the arguments give (megatron/training/tokenizer):
# _NullTokenizer(vocab_size) adds its EOD token at id vocab_size; _TikTokenizer's vocab_size is
# the whole vocabulary, special tokens included.
_VOCAB_PLUS_EOD = ("NullTokenizer", "NullMultimodalTokenizer")
_VOCAB_AS_IS = ("TikTokenizer",)


def vocabulary(args: dict[str, Any], padded: int, override: int | None = None) -> tuple[int, str | None]:
    """The vocabulary the run's tokenizer had, as Megatron-LM computes it from the arguments, and
    a note when it is not known (the padded size is kept then). ``override``: ``--vocab-size``."""
    if override is not None:
        if type(override) is not int or not 0 < override <= padded:
            raise OptionError(f"--vocab-size {override!r} does not fit the {padded} stored rows (padded_vocab_size)")
        return override, None
    tokenizer = args.get("tokenizer_type")
    size = args.get("vocab_size")
    if tokenizer in _VOCAB_PLUS_EOD or tokenizer in _VOCAB_AS_IS:
        if type(size) is not int or size <= 0:
            raise ArgsError(f"argument vocab_size is {size!r}, not a positive integer ({tokenizer} needs it)")
        vocab = size + 1 if tokenizer in _VOCAB_PLUS_EOD else size
        if vocab > padded:
            raise ArgsError(f"the {tokenizer} vocabulary of {vocab} (vocab_size={size}) does not fit "
                            f"padded_vocab_size={padded}")
        return vocab, None
    shown = f"tokenizer_type={tokenizer!r}" if tokenizer else "no tokenizer_type"
    return padded, (f"{shown}: the tokenizer's size is not in the arguments, so all {padded} rows "
                    "(padded_vocab_size) are kept; pass --vocab-size N to keep the first N")


def _family(args: dict[str, Any], experts: int, qkv_bias: bool, qk_norm: bool) -> Family:
    if experts and qkv_bias:
        raise ArgsError("a mixture of experts with a QKV bias (Qwen2-MoE, GLM-4.5) is not covered")
    if qkv_bias and qk_norm:
        raise ArgsError("a QKV bias with query/key norms (qk_layernorm) is not covered")
    if experts:
        return FAMILIES["qwen3_moe" if qk_norm else "mixtral"]
    return FAMILIES["qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"]


def _dense_ids(args: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The dense layers Megatron's ``moe_layer_freq`` makes: an int N puts experts in every N-th
    layer from layer 0 (``i % N == 0``), a list says it per layer (1: MoE)."""
    freq = _get(args, "moe_layer_freq", default=1)
    if type(freq) is int and freq > 0:
        return tuple(i for i in range(layers) if i % freq)
    if isinstance(freq, list) and len(freq) == layers and all(v in (0, 1) for v in freq):
        return tuple(i for i, v in enumerate(freq) if not v)
    raise ArgsError(f"moe_layer_freq={freq!r} is neither a positive integer nor a 0/1 list of num_layers={layers}")


def check_basics(args: dict[str, Any]) -> None:
    """What no family covers: LayerNorm, a non-gated MLP, other position embeddings, linear
    biases, 1p norms. Raises ArgsError."""
    for name, covered, what in _UNCOVERED[1:6]:
        value = args.get(name)
        if value is None and name in ("swiglu", "normalization", "position_embedding_type"):
            raise ArgsError(f"argument {name} is not recorded")
        if value is not None and value != covered:
            raise ArgsError(f"{name}={value!r} ({what}) is not covered by any mapping")


def describe(args: dict[str, Any], dtype: str | None, vocab_size: int | None = None,
             no_mtp: bool = False) -> Described:
    """Family, sizes and ``config.json`` of the model ``args`` describe (``dtype``: the config
    name of the weights' dtype; ``vocab_size``: ``--vocab-size``; ``no_mtp``: ``--no-mtp``).
    Raises ArgsError."""
    check_basics(args)
    if _get(args, "mtp_num_layers") and not no_mtp:
        raise ArgsError(f"mtp_num_layers={args['mtp_num_layers']!r}: MTP layers are covered by the DeepSeek-V3 and "
                        "GLM-4.5 mappings only", )
    for name, covered, what in _UNCOVERED:
        value = args.get(name)
        if value is None and name in ("swiglu", "normalization", "position_embedding_type"):
            raise ArgsError(f"argument {name} is not recorded")
        if value is not None and value != covered:
            raise ArgsError(f"{name}={value!r} ({what}) is not covered by the Llama, Qwen2, Qwen3 or Mixtral "
                            "mappings")
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
        raise ArgsError("moe_shared_expert_intermediate_size (shared experts) is not covered by the Mixtral or "
                        "Qwen3-MoE mappings")
    dense_ids = _dense_ids(args, layers) if experts else ()
    if dense_ids and not args.get("qk_layernorm"):
        raise ArgsError(f"moe_layer_freq={args['moe_layer_freq']!r} (dense layers between MoE layers) is covered by "
                        "the Qwen3-MoE mapping (QK norms) only")
    if experts and _get(args, "moe_router_score_function", default="softmax") != "softmax":
        raise ArgsError(f"moe_router_score_function={args['moe_router_score_function']!r} is not covered")
    if experts and _float(args, "moe_router_topk_scaling_factor", default=1.0) != 1.0:
        raise ArgsError(f"moe_router_topk_scaling_factor={args['moe_router_topk_scaling_factor']!r} is not covered")
    ffn = _int(args, "ffn_hidden_size") if not experts or _get(args, "ffn_hidden_size") or dense_ids else 0
    moe_ffn = _int(args, "moe_ffn_hidden_size", "ffn_hidden_size") if experts else 0
    padded = _int(args, "padded_vocab_size", "vocab_size")
    vocab, note = vocabulary(args, padded, vocab_size)
    tied = not bool(args.get("untie_embeddings_and_output_weights", False))
    qkv_bias = bool(args.get("add_qkv_bias", False))
    qk_norm = bool(args.get("qk_layernorm", False))
    fam = _family(args, experts, qkv_bias, qk_norm)
    theta = _float(args, "rotary_base", default=10000)
    eps = _float(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)
    cfg: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": fam.name, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": moe_ffn if fam.name == "mixtral" else ffn or moe_ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": _int(args, "max_position_embeddings", "seq_length", default=4096),
        "rms_norm_eps": eps, "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": tied, "attention_dropout": 0.0, "use_cache": True,
    }
    if fam.name == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if fam.name in ("qwen2", "qwen3", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if fam.name in ("qwen3", "qwen3_moe"):
        cfg.update(attention_bias=False)
    if fam.name == "mixtral":
        cfg.update(num_local_experts=experts, num_experts_per_tok=_int(args, "moe_router_topk", default=2),
                   router_aux_loss_coef=_float(args, "moe_aux_loss_coeff", default=0.0), sliding_window=None)
    if fam.name == "qwen3_moe":  # Megatron's softmax after the top-k: the chosen probabilities sum to 1
        cfg.update(num_experts=experts, num_experts_per_tok=_int(args, "moe_router_topk", default=2),
                   moe_intermediate_size=moe_ffn, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=list(dense_ids),
                   router_aux_loss_coef=_float(args, "moe_aux_loss_coeff", default=0.0))
    if dtype:
        cfg["dtype"] = dtype
    dims = Dims(layers, heads, groups, head_dim, ffn, vocab, experts, tied, hidden=hidden, moe_ffn=moe_ffn,
                dense_ids=dense_ids)
    return Described(fam, dims, dict(sorted(cfg.items())), note)


def summary(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments inspect shows (those that decide the architecture), as recorded."""
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
            "num_query_groups", "kv_channels", "normalization", "norm_epsilon", "layernorm_epsilon", "swiglu",
            "position_embedding_type", "rotary_base", "rotary_percent", "add_bias_linear", "add_qkv_bias",
            "untie_embeddings_and_output_weights", "vocab_size", "padded_vocab_size", "num_experts",
            "moe_router_topk", "moe_ffn_hidden_size", "qk_layernorm", "tokenizer_type", "moe_grouped_gemm", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "expert_model_parallel_size", "transformer_impl", "ckpt_format", "bf16", "fp16", "params_dtype")
    return {k: args[k] for k in keys if k in args}


# Megatron-Bridge's run_config.yaml: the model section holds TransformerConfig's (and the model
# provider's) fields, named as megatron-core names them; the arguments these describers read:
_RUN_MODEL_NAMES = {
    "num_moe_experts": "num_experts", "layernorm_epsilon": "norm_epsilon",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p", "seq_length": "seq_length",
}
_RUN_SAME = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "normalization", "position_embedding_type", "rotary_base", "rotary_percent", "add_bias_linear",
             "add_qkv_bias", "qk_layernorm", "max_position_embeddings", "multi_latent_attention", "q_lora_rank",
             "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
             "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "mtp_num_layers", "moe_router_topk", "moe_ffn_hidden_size",
             "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_router_score_function",
             "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_num_groups",
             "moe_router_group_topk", "moe_router_pre_softmax", "moe_grouped_gemm", "moe_aux_loss_coeff")


def args_from_run_config(doc: dict[str, Any], padded: int) -> dict[str, Any]:
    """The arguments the describers read, from a Megatron-Bridge ``run_config.yaml`` (its
    ``model`` and ``tokenizer`` sections; ``padded``: the embedding's rows, which Bridge does not
    record). Raises ArgsError when the model section is missing."""
    model, tok = doc.get("model"), doc.get("tokenizer")
    if not isinstance(model, dict):
        raise ArgsError("run_config.yaml has no model section, so the HF architecture is not known")
    tok = tok if isinstance(tok, dict) else {}
    args: dict[str, Any] = {k: model[k] for k in _RUN_SAME if k in model}
    args.update({new: model[old] for old, new in _RUN_MODEL_NAMES.items() if old in model})
    act = model.get("activation_func")
    target = act.get("_target_") if isinstance(act, dict) else act
    silu = isinstance(target, str) and target.rsplit(".", 1)[-1] == "silu"
    args["swiglu"] = bool(model.get("gated_linear_unit")) and silu
    groups = model.get("num_query_groups")
    args["group_query_attention"] = groups is not None and groups != model.get("num_attention_heads")
    share = model.get("share_embeddings_and_output_weights", True)
    args["untie_embeddings_and_output_weights"] = not share
    args["padded_vocab_size"] = padded
    args["tokenizer_type"] = tok.get("tokenizer_type")
    args["vocab_size"] = tok.get("vocab_size")
    return {k: v for k, v in args.items() if v is None or isinstance(v, (bool, int, float, str, list))}
