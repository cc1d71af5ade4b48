"""The ``config.json`` of the DeepSeek-V3-style families (``deepseek_v3``, which Kimi-K2 shares,
and ``glm4_moe``) from a Megatron-LM run's arguments: MLA or GQA with a QKV bias and QK norms,
leading dense layers (``moe_layer_freq``), shared experts, the sigmoid router with expert bias,
group routing, the top-k scaling factor, YaRN (MLA) or partial rotary (GLM), and the MTP layers.

What transformers' modules compute that Megatron's must match, and is refused otherwise:
the router's sigmoid scores with ``e_score_correction_bias``, the chosen weights normalised
(Megatron does so for top-k > 1) then scaled; groups scored by their top-2 experts (Megatron:
top ``topk / group_topk``); dense layers first, then MoE layers to the end (``first_k_dense_replace``).
"""

from __future__ import annotations

from typing import Any

from ckptctl.sources.megatron.config import ArgsError, Described, _float, _get, _int, check_basics, describe, vocabulary
from ckptctl.sources.megatron.mapping import FAMILIES, Dims


def describe_any(args: dict[str, Any], dtype: str | None, vocab_size: int | None = None,
                 no_mtp: bool = False) -> Described:
    """The family the arguments describe, whichever it is: :func:`describe_v3` for a
    DeepSeek-V3/GLM-4.5-style model, else :func:`~ckptctl.sources.megatron.config.describe`."""
    check_basics(args)
    if wants_v3(args):
        return describe_v3(args, dtype, vocab_size, no_mtp)
    return describe(args, dtype, vocab_size, no_mtp)


def wants_v3(args: dict[str, Any]) -> bool:
    """Whether the arguments describe a DeepSeek-V3/GLM-4.5-style model (MLA, or experts with a
    sigmoid router, shared experts or dense layers among them)."""
    if args.get("multi_latent_attention"):
        return True
    if not _get(args, "num_experts"):
        return False
    return (_get(args, "moe_router_score_function", default="softmax") == "sigmoid"
            or bool(_get(args, "moe_shared_expert_intermediate_size"))
            or isinstance(args.get("moe_layer_freq"), list) and not args.get("qk_layernorm"))


def _dense_layers(args: dict[str, Any], layers: int) -> int:
    """How many leading layers are dense: ``moe_layer_freq`` 1, or a list of 0s then 1s."""
    freq = _get(args, "moe_layer_freq", default=1)
    if freq == 1:
        return 0
    if not isinstance(freq, list) or len(freq) != layers or any(v not in (0, 1) for v in freq):
        raise ArgsError(f"moe_layer_freq={freq!r} is not a list of 0 and 1 per layer (num_layers={layers}); "
                        "only leading dense layers are covered")
    k = freq.index(1) if 1 in freq else layers
    if any(v != 1 for v in freq[k:]):
        raise ArgsError(f"moe_layer_freq={freq!r} puts dense layers after MoE layers; transformers' "
                        "first_k_dense_replace has them first only")
    return k


def _router(args: dict[str, Any], experts: int) -> dict[str, Any]:
    if _get(args, "moe_router_score_function", default="softmax") != "sigmoid":
        raise ArgsError(f"moe_router_score_function={args.get('moe_router_score_function')!r}: the DeepSeek-V3 and "
                        "GLM-4.5 mappings cover the sigmoid router")
    if not args.get("moe_router_enable_expert_bias"):
        raise ArgsError("moe_router_enable_expert_bias is off: the DeepSeek-V3 and GLM-4.5 mappings need the "
                        "expert bias (e_score_correction_bias)")
    if args.get("moe_router_pre_softmax"):
        raise ArgsError("moe_router_pre_softmax=True (a softmax before the top-k choice) is not covered")
    topk = _int(args, "moe_router_topk", default=2)
    groups = _int(args, "moe_router_num_groups", default=1)
    group_topk = _int(args, "moe_router_group_topk", default=1)
    if experts % groups:
        raise ArgsError(f"{experts} experts do not divide into moe_router_num_groups={groups}")
    if groups > 1 and topk != 2 * group_topk:
        raise ArgsError(f"moe_router_topk={topk} over moe_router_group_topk={group_topk} scores each group by its "
                        f"top {topk // group_topk}; transformers scores it by its top 2")
    return {"n_routed_experts": experts, "num_experts_per_tok": topk, "n_group": groups, "topk_group": group_topk,
            "routed_scaling_factor": _float(args, "moe_router_topk_scaling_factor", default=1.0),
            "norm_topk_prob": topk > 1}


def _rope(args: dict[str, Any], theta: float, mla: bool) -> dict[str, Any]:
    kind = _get(args, "rope_type", default="rope" if not mla else "yarn")
    if kind == "rope":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise ArgsError(f"rope_type={kind!r} is not covered")
    return {"rope_type": "yarn", "rope_theta": theta, "factor": _float(args, "rotary_scaling_factor", default=40.0),
            "original_max_position_embeddings": _int(args, "original_max_position_embeddings",
                                                     "yarn_original_max_position_embeddings", default=4096),
            "beta_fast": _float(args, "beta_fast", "yarn_beta_fast", default=32.0),
            "beta_slow": _float(args, "beta_slow", "yarn_beta_slow", default=1.0),
            "mscale": _float(args, "mscale", "yarn_mscale", default=1.0),
            "mscale_all_dim": _float(args, "mscale_all_dim", "yarn_mscale_all_dim", default=0.0)}


def describe_v3(args: dict[str, Any], dtype: str | None, vocab_size: int | None = None,
                no_mtp: bool = False) -> Described:
    """Family, sizes and ``config.json`` of a DeepSeek-V3 (MLA) or GLM-4.5 (GQA) style model.
    Raises ArgsError."""
    mla = bool(args.get("multi_latent_attention"))
    layers, hidden = _int(args, "num_layers"), _int(args, "hidden_size")
    heads = _int(args, "num_attention_heads")
    experts = _int(args, "num_experts") if _get(args, "num_experts") else 0
    if not experts:
        raise ArgsError("multi-latent attention (MLA) without experts is not covered (DeepSeek-V3 has them)")
    moe_ffn = _int(args, "moe_ffn_hidden_size", "ffn_hidden_size")
    shared = _get(args, "moe_shared_expert_intermediate_size")
    if not shared:
        raise ArgsError("no shared experts (moe_shared_expert_intermediate_size): the DeepSeek-V3 and GLM-4.5 "
                        "mappings need them")
    shared = _int(args, "moe_shared_expert_intermediate_size")
    if shared % moe_ffn:
        raise ArgsError(f"moe_shared_expert_intermediate_size={shared} is not a multiple of "
                        f"moe_ffn_hidden_size={moe_ffn} (n_shared_experts)")
    dense = _dense_layers(args, layers)
    ffn = _int(args, "ffn_hidden_size") if dense else moe_ffn
    padded = _int(args, "padded_vocab_size", "vocab_size")
    vocab, note = vocabulary(args, padded, vocab_size)
    tied = not bool(args.get("untie_embeddings_and_output_weights", False))
    mtp = 0 if no_mtp else (_int(args, "mtp_num_layers") if _get(args, "mtp_num_layers") else 0)
    theta = _float(args, "rotary_base", default=10000)
    rotary = _float(args, "rotary_percent", default=1.0)
    qkv_bias, qk_norm = bool(args.get("add_qkv_bias")), bool(args.get("qk_layernorm"))
    cfg: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn, "moe_intermediate_size": moe_ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "n_shared_experts": shared // moe_ffn,
        "first_k_dense_replace": dense, "hidden_act": "silu",
        "max_position_embeddings": _int(args, "max_position_embeddings", "seq_length", default=4096),
        "rms_norm_eps": _float(args, "norm_epsilon", "layernorm_epsilon", default=1e-5), "tie_word_embeddings": tied,
        "attention_dropout": 0.0, "use_cache": True, "num_nextn_predict_layers": mtp, **_router(args, experts)}
    if mla:
        if qkv_bias or rotary != 1.0:
            raise ArgsError("MLA with a QKV bias or partial rotary is not covered")
        q_lora = _int(args, "q_lora_rank") if _get(args, "q_lora_rank") else 0
        kv_lora, qk = _int(args, "kv_lora_rank"), _int(args, "qk_head_dim")
        rope, v = _int(args, "qk_pos_emb_head_dim"), _int(args, "v_head_dim")
        fam = FAMILIES["deepseek_v3"]
        cfg.update(num_key_value_heads=heads, q_lora_rank=q_lora or None, kv_lora_rank=kv_lora,
                   qk_nope_head_dim=qk, qk_rope_head_dim=rope, v_head_dim=v, head_dim=rope, rope_interleave=True,
                   attention_bias=False, rope_parameters=_rope(args, theta, True))
        dims = Dims(layers, heads, heads, qk + rope, ffn, vocab, experts, tied, hidden=hidden, moe_ffn=moe_ffn,
                    shared=shared, dense_layers=dense, mtp=mtp, drop_mtp=no_mtp, mla=(q_lora, kv_lora, qk, rope, v))
    else:
        if not qkv_bias:
            raise ArgsError("experts with a sigmoid router or shared experts but no QKV bias and no MLA match "
                            "neither DeepSeek-V3 nor GLM-4.5")
        groups = _int(args, "num_query_groups", default=heads) if args.get("group_query_attention") else heads
        head_dim = _int(args, "kv_channels", default=hidden // heads)
        if heads % groups:
            raise ArgsError(f"{heads} attention heads do not divide into {groups} query groups")
        fam = FAMILIES["glm4_moe"]
        cfg.update(num_key_value_heads=groups, head_dim=head_dim, attention_bias=True, use_qk_norm=qk_norm,
                   partial_rotary_factor=rotary,
                   rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary})
        dims = Dims(layers, heads, groups, head_dim, ffn, vocab, experts, tied, hidden=hidden, moe_ffn=moe_ffn,
                    shared=shared, dense_layers=dense, mtp=mtp, drop_mtp=no_mtp, qk_norm=qk_norm)
    cfg.update(architectures=[fam.architecture], model_type=fam.name)
    if dtype:
        cfg["dtype"] = dtype
    return Described(fam, dims, dict(sorted(cfg.items())), note)
