"""A Megatron checkpoint without its arguments (megatron-core >= 0.17 writes no ``common.pt``;
Megatron-Bridge and NeMo-RL checkpoints carry no ``args``), mapped through the target Hugging
Face ``config.json`` the user gives (``--config``): its ``model_type`` picks the family, its
sizes are the mapping's :class:`~ckptctl.sources.megatron.mapping.Dims` and are checked against
the tensors like the arguments are (a contradiction names the config field), and it is
published as given (``num_nextn_predict_layers`` 0 with ``--no-mtp``). Never a guessed family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptctl.errors import InputError
from ckptctl.sources.megatron.config import ArgsError, Described, bounded
from ckptctl.sources.megatron.mapping import FAMILIES, Dims

# the Megatron argument a mapping message names -> the config.json field that says it here
CONFIG_WORDS = (
    ("moe_shared_expert_intermediate_size", "n_shared_experts x moe_intermediate_size"),
    ("moe_ffn_hidden_size", "moe_intermediate_size"), ("ffn_hidden_size", "intermediate_size"),
    ("num_query_groups", "num_key_value_heads"), ("kv_channels", "head_dim"), ("num_layers", "num_hidden_layers"),
    ("qk_pos_emb_head_dim", "qk_rope_head_dim"), ("qk_head_dim", "qk_nope_head_dim"),
    ("num_experts", "the expert count"), ("mtp_num_layers", "num_nextn_predict_layers"),
    ("moe_layer_freq", "first_k_dense_replace"), ("the arguments say", "--config says"), ("the arguments", "--config"),
)


def in_config_words(message: str) -> str:
    """A mapping message with the Megatron arguments it names said as config.json fields."""
    for arg, field in CONFIG_WORDS:
        message = message.replace(arg, field)
    return message


def read_target_config(path: str | Path) -> dict[str, Any]:
    """The ``--config`` file, bounded. Raises InputError."""
    from ckptctl.format import small

    try:
        cfg = small.read_json(path, follow=True)
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(f"--config {path}: not a readable config.json ({exc})",
                         "pass the Hugging Face config.json of the model the checkpoint trained") from None
    if not isinstance(cfg, dict):
        raise InputError(f"--config {path}: not a JSON object", "pass a Hugging Face config.json")
    return cfg


def _int(cfg: dict[str, Any], name: str, default: int | None = None, zero: bool = False) -> int:
    v = cfg.get(name, default)
    if type(v) is not int or v < 0 or (v == 0 and not zero):
        raise ArgsError(f"--config field {name} is {v!r}, not a {'non-negative' if zero else 'positive'} integer")
    return bounded(f"--config field {name}", v)


def describe_hf(cfg: dict[str, Any], no_mtp: bool = False) -> Described:
    """Family and sizes of the model ``cfg`` (a Hugging Face config.json) describes. Raises ArgsError."""
    kind = cfg.get("model_type")
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise ArgsError(f"--config model_type {kind!r} has no Megatron mapping (covered: {', '.join(FAMILIES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ArgsError(f"--config hidden_act {cfg.get('hidden_act')!r}: Megatron's gated MLP here is SiLU")
    if kind == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ArgsError("--config attention_bias/mlp_bias: a Llama with biases has no Megatron mapping")
    layers, hidden, heads = _int(cfg, "num_hidden_layers"), _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    groups = _int(cfg, "num_key_value_heads", heads)
    if heads % groups:
        raise ArgsError(f"--config: {heads} attention heads do not divide into {groups} key/value heads")
    experts = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts",
               "glm4_moe": "n_routed_experts"}.get(kind)
    n_exp = _int(cfg, experts) if experts else 0
    moe_ffn = _int(cfg, "intermediate_size" if kind == "mixtral" else "moe_intermediate_size") if n_exp else 0
    tied = bool(cfg.get("tie_word_embeddings", False))
    v3 = kind in ("deepseek_v3", "glm4_moe")
    mtp = 0 if no_mtp or not v3 else _int(cfg, "num_nextn_predict_layers", 0, zero=True)
    extra: dict[str, Any] = {}
    if v3:
        extra = dict(shared=_int(cfg, "n_shared_experts", 1) * moe_ffn,
                     dense_layers=_int(cfg, "first_k_dense_replace", 0, zero=True), mtp=mtp, drop_mtp=no_mtp)
    head_dim = _int(cfg, "head_dim", hidden // heads) if kind != "deepseek_v3" else 0
    if kind == "deepseek_v3":
        q_lora = cfg.get("q_lora_rank")
        q_lora = _int(cfg, "q_lora_rank") if q_lora is not None else 0
        mla = (q_lora, _int(cfg, "kv_lora_rank"), _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim"),
               _int(cfg, "v_head_dim"))
        head_dim, extra["mla"] = mla[2] + mla[3], mla
    if kind == "glm4_moe":
        extra["qk_norm"] = bool(cfg.get("use_qk_norm", False))
    if kind == "qwen3_moe":  # transformers: MoE where (i + 1) % decoder_sparse_step == 0, unless mlp_only
        step, only = _int(cfg, "decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(type(i) is int for i in only):
            raise ArgsError(f"--config mlp_only_layers {only!r} is not a list of layer numbers")
        extra["dense_ids"] = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    dense = bool(extra.get("dense_ids"))
    ffn = _int(cfg, "intermediate_size") if kind not in ("mixtral", "qwen3_moe") or dense else moe_ffn
    dims = Dims(layers, heads, groups, head_dim, ffn, _int(cfg, "vocab_size"), n_exp, tied, hidden=hidden,
                moe_ffn=moe_ffn, **extra)
    out = dict(cfg)
    if no_mtp and v3:
        out["num_nextn_predict_layers"] = 0
    return Described(FAMILIES[kind], dims, out)
