"""The decoder-only architectures whose tensor shapes ``verify`` checks against config.json: the
fallback for the model-class check (:mod:`ckptctl.verify.classes`), which decides every shape of
every class the installed library knows. These rules run with ``--static`` or where it cannot
run; the bias rows are gone (a bias's shape follows its projection's rows, checked here, and the
class check decides a bias the config adds or removes).

Each :class:`Spec` names the embedding, the layer container, the output head and, per tensor of a
layer, the shape the config's dimensions give it (:class:`Dims`, read through the one table of
config field names, :mod:`ckptctl.config_fields`):

* Llama-style names (Llama, Mistral, Mixtral, Qwen2/3, Gemma 1-3, Phi-3, most VLM text towers):
  ``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
  ``lm_head``;
* GPT-2 names (``transformer.wte/wpe``, ``h.{i}.attn.c_attn``): Conv1D weights stored [in, out] for GPT-2,
  nn.Linear [out, in] for GPT-Neo and GPT-BigCode (multi-query c_attn);
* GPT-NeoX (``gpt_neox.embed_in``, ``layers.{i}.attention.query_key_value``, ``embed_out``);
* Falcon / Bloom (``transformer.word_embeddings``, ``h.{i}.self_attention.query_key_value``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from ckptctl.config_fields import ConfigFields, as_int


@dataclass
class Dims:
    """The sizes a config gives a model family's tensors (None where the config does not say)."""

    hidden: int | None = None
    heads: int | None = None
    kv: int | None = None
    head_dim: int | None = None
    inter: int | None = None
    vocab: int | None = None
    layers: int | None = None
    max_pos: int | None = None
    v_head_dim: int | None = None  # DeepSeek MLA: o_proj reads heads x v_head_dim
    q_head_dim: int | None = None  # DeepSeek MLA: q_proj gives heads x (qk_nope_head_dim + qk_rope_head_dim)
    linear: bool | None = False  # GPT-2 names: True nn.Linear [out, in] layout, False Conv1D [in, out], None unknown


class Rule(NamedTuple):
    """The shape one tensor of every layer must have, from the config's dims."""

    suffix: str  # tensor name inside a layer, e.g. "self_attn.q_proj.weight"
    shape: Callable[[Dims], tuple[int | None, ...] | None]
    code: str
    what: str  # which config fields decide the shape


class Spec(NamedTuple):
    """A model family's tensor names (embedding, layer container, lm head) and its per-layer shape
    rules."""

    name: str
    embed: str
    layer: str  # "layers" or "h"
    lm_head: str
    rules: tuple[Rule, ...]
    position: str | None = None
    dims: Callable[[ConfigFields], Dims] | None = None
    # the model types whose layout these rules describe (the config's, or its text_config's): for
    # another family with the same names the shapes are not checked, and a note says so
    model_types: frozenset[str] = frozenset()


def _mul(*xs: int | None) -> int | None:
    out = 1
    for x in xs:
        if x is None:
            return None
        out *= x
    return out


# gated attention: q_proj holds the query and its output gate (num_attention_heads x head_dim x 2)
GATED_QUERY_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                               "qwen4_exp", "qwen4_exp_text"})


def _llama_dims(c: ConfigFields) -> Dims:
    d = Dims(hidden=as_int(c.get("hidden_size")), heads=as_int(c.get("num_attention_heads")),
             inter=as_int(c.get("intermediate_size")), vocab=as_int(c.get("vocab_size")),
             layers=as_int(c.get("num_hidden_layers")), max_pos=as_int(c.get("max_position_embeddings")))
    d.kv = as_int(c.get("num_key_value_heads")) or d.heads
    d.head_dim = as_int(c.get("head_dim"))
    if d.head_dim is None and d.hidden and d.heads:
        d.head_dim = d.hidden // d.heads
    d.v_head_dim = as_int(c.get("v_head_dim")) or d.head_dim
    nope, rope = as_int(c.get("qk_nope_head_dim")), as_int(c.get("qk_rope_head_dim"))
    d.q_head_dim = nope + rope if nope is not None and rope is not None else d.head_dim
    mt = c.get("model_type")  # untrusted: any JSON value
    if isinstance(mt, str) and mt in GATED_QUERY_TYPES and d.q_head_dim:
        d.q_head_dim *= 2
    return d


# Families whose layers are Llama's (q/k/v/o of num_attention_heads and num_key_value_heads x
# head_dim, a fused qkv_proj as q + k + v, gate/up/down or gate_up of intermediate_size), read
# from each family's modeling code; their multimodal text towers name them in text_config.
LLAMA_TYPES = frozenset({
    "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3", "gemma3_text", "phi", "phi3", "phimoe", "stablelm", "cohere", "cohere2", "olmo", "olmo2", "olmo3",
    "olmoe", "deepseek_v2", "deepseek_v3", "glm", "glm4", "glm4_moe", "granite", "granitemoe",
    "granitemoeshared", "helium", "smollm3", "ernie4_5", "ernie4_5_moe", "exaone4", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "arcee", "apertus", "seed_oss", "dots1", "bitnet", "starcoder2", "minicpm", "nemotron",
    "qwen2_vl_text", "qwen2_5_vl_text", *GATED_QUERY_TYPES})

# GPT-2 tensor names with Conv1D weights ([in, out]) and with nn.Linear weights ([out, in]);
# another model_type with GPT-2 names is not shape-checked (a rule does not guess a layout)
CONV1D_TYPES = frozenset({"gpt2", "imagegpt", "decision_transformer"})
LINEAR_TYPES = frozenset({"gpt_neo", "gpt_bigcode"})


def _gpt2_dims(c: ConfigFields) -> Dims:
    d = _llama_dims(c)
    if d.inter is None and d.hidden:
        d.inter = 4 * d.hidden
    d.kv = 1 if c.get("multi_query") is True else d.heads  # GPT-BigCode's multi-query attention
    mt = c.get("model_type")
    if mt is not None and not isinstance(mt, str):
        mt = ""  # untrusted: a list or a number is no model_type (unhashable for the sets)
    d.linear = True if mt in LINEAR_TYPES else False if mt in CONV1D_TYPES or mt is None else None
    return d


def _io(d: Dims, n_in: int | None, n_out: int | None) -> tuple[int | None, ...] | None:
    """A GPT-2-named weight's shape: [in, out] for Conv1D, [out, in] for nn.Linear, None when unknown."""
    if d.linear is None:
        return None
    return (n_out, n_in) if d.linear else (n_in, n_out)


def _falcon_dims(c: ConfigFields) -> Dims:
    d = _llama_dims(c)
    if as_int(c.get("ffn_hidden_size")):
        d.inter = as_int(c.get("ffn_hidden_size"))
    elif d.inter is None and d.hidden:
        d.inter = 4 * d.hidden
    if d.hidden and d.heads:
        d.head_dim = d.hidden // d.heads
    if c.get("new_decoder_architecture"):
        d.kv = as_int(c.get("num_kv_heads")) or d.heads
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
    Rule("self_attn.q_proj.weight", lambda d: (_mul(d.heads, d.q_head_dim), d.hidden), _ATT,
         _Q_WHAT + " (MLA: qk_nope_head_dim + qk_rope_head_dim; gated attention (Qwen3-Next): twice)"),
    Rule("self_attn.k_proj.weight", lambda d: (_mul(d.kv, d.head_dim), d.hidden), _KV, _KV_WHAT),
    Rule("self_attn.v_proj.weight", lambda d: (_mul(d.kv, d.head_dim), d.hidden), _KV, _KV_WHAT),
    Rule("self_attn.o_proj.weight", lambda d: (d.hidden, _mul(d.heads, d.v_head_dim)), _ATT,
         "hidden_size by num_attention_heads x head_dim (MLA: v_head_dim)"),
    Rule("self_attn.qkv_proj.weight",
         lambda d: (None if d.heads is None or d.kv is None or d.head_dim is None
                    else (d.heads + 2 * d.kv) * d.head_dim, d.hidden), _ATT,
         "(num_attention_heads + 2 x num_key_value_heads) x head_dim by hidden_size"),
    Rule("mlp.gate_proj.weight", lambda d: (d.inter, d.hidden), _MLP, "intermediate_size by hidden_size"),
    Rule("mlp.up_proj.weight", lambda d: (d.inter, d.hidden), _MLP, "intermediate_size by hidden_size"),
    Rule("mlp.down_proj.weight", lambda d: (d.hidden, d.inter), _MLP, "hidden_size by intermediate_size"),
    Rule("mlp.gate_up_proj.weight", lambda d: (_mul(2, d.inter), d.hidden), _MLP,
         "2 x intermediate_size by hidden_size"),
), dims=_llama_dims, model_types=LLAMA_TYPES)

_LAYOUT = " (Conv1D stores [in, out] for gpt2, nn.Linear [out, in] for gpt_neo and gpt_bigcode)"
GPT2 = Spec("gpt2", "wte.weight", "h", "lm_head.weight", (
    Rule("attn.c_attn.weight",
         lambda d: _io(d, d.hidden, None if d.hidden is None or d.kv is None or d.head_dim is None
                       else d.hidden + 2 * d.kv * d.head_dim), _ATT,
         "n_embd to n_embd + 2 x kv heads x head_dim (kv heads: 1 with multi_query)" + _LAYOUT),
    Rule("attn.c_proj.weight", lambda d: _io(d, d.hidden, d.hidden), _ATT, "n_embd to n_embd" + _LAYOUT),
    Rule("mlp.c_fc.weight", lambda d: _io(d, d.hidden, d.inter), _MLP,
         "n_embd to n_inner (default 4 x n_embd)" + _LAYOUT),
    Rule("mlp.c_proj.weight", lambda d: _io(d, d.inter, d.hidden), _MLP, "n_inner to n_embd" + _LAYOUT),
), position="wpe.weight", dims=_gpt2_dims, model_types=CONV1D_TYPES | LINEAR_TYPES)

def _dense_4h(inter: str) -> tuple[Rule, Rule]:
    """The MLP of GPT-NeoX and Falcon/Bloom: ``dense_h_to_4h`` and ``dense_4h_to_h``, whose
    intermediate size the config calls ``inter``."""
    return (Rule("mlp.dense_h_to_4h.weight", lambda d: (d.inter, d.hidden), _MLP, f"{inter} by hidden_size"),
            Rule("mlp.dense_4h_to_h.weight", lambda d: (d.hidden, d.inter), _MLP, f"hidden_size by {inter}"))


NEOX = Spec("gpt-neox", "embed_in.weight", "layers", "embed_out.weight", (
    Rule("attention.query_key_value.weight", lambda d: (_mul(3, d.heads, d.head_dim), d.hidden), _ATT,
         "3 x num_attention_heads x head_dim by hidden_size"),
    Rule("attention.dense.weight", lambda d: (d.hidden, _mul(d.heads, d.head_dim)), _ATT,
         "hidden_size by num_attention_heads x head_dim"),
    *_dense_4h("intermediate_size"),
), dims=_gpt2_dims, model_types=frozenset({"gpt_neox"}))

FALCON = Spec("falcon/bloom", "word_embeddings.weight", "h", "lm_head.weight", (
    Rule("self_attention.query_key_value.weight",
         lambda d: (None if d.heads is None or d.kv is None or d.head_dim is None
                    else (d.heads + 2 * d.kv) * d.head_dim, d.hidden), _ATT,
         "(num_attention_heads + 2 x kv heads) x head_dim by hidden_size (kv heads: num_kv_heads with "
         "new_decoder_architecture, 1 with multi_query)"),
    Rule("self_attention.dense.weight", lambda d: (d.hidden, _mul(d.heads, d.head_dim)), _ATT,
         "hidden_size by hidden_size"),
    *_dense_4h("ffn_hidden_size"),
), dims=_falcon_dims, model_types=frozenset({"falcon", "bloom"}))

SPECS = (LLAMA, GPT2, NEOX, FALCON)


def unknown_family(spec: Spec, cfg: dict) -> str | None:
    """The model type to name when ``cfg``'s family (its model_type, or its text_config's) is not
    one whose layout ``spec``'s rules describe; None when it is, or when the config names none
    (config.missing_field says that). Untrusted: only strings count."""
    text = cfg.get("text_config")
    types = [t for t in (cfg.get("model_type"), text.get("model_type") if isinstance(text, dict) else None)
             if isinstance(t, str)]
    if not types or any(t in spec.model_types for t in types):
        return None
    return types[0]

# architectures whose name says the model generates text (its config wants a generation config and
# a tokenizer, and an untied lm_head must be stored)
GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
