"""Megatron-core GPT names to Hugging Face names: one declarative table per family, and the
pure arithmetic that turns it into output tensors.

A Megatron ``torch_dist`` checkpoint stores each tensor with its global shape, and the
transformer block stacks its layers: ``decoder.layers.mlp.linear_fc1.weight`` is
``[num_layers, 2 * ffn, hidden]`` (the experts of an MoE layer add an expert dimension after the
layer's). Each HF tensor is a sub-block of one of them: fixed indices in the stacked dimensions
(layer, expert), then rows ``[a, b)`` of the next dimension and everything after it (a
:class:`Slab`), or several such slabs one under the other (the query rows of every query group).
The operations of a :class:`Rule`:

- ``copy``: the whole slab (a norm weight, ``linear_proj``, ``linear_fc2``, the router);
- ``vocab``: rows ``[0, vocab)``: the embedding and output layer without Megatron's padding;
- ``qkv``: ``linear_qkv`` holds, per query group, its ``heads / groups`` query heads, then one
  key head and one value head (``kv_channels`` rows each): q, k and v each take their rows of
  every group, in group order (weights and, for Qwen2, biases);
- ``glu``: ``linear_fc1`` of a gated MLP is ``[gate; up]`` (``ffn`` rows each, whatever the
  tensor-parallel degree was: Megatron saves the two halves as separate global ranges).

A model whose layers differ (a ``moe_layer_freq`` list, MTP) is saved with per-layer keys,
``decoder.layers.{i}.<name>`` without the layer dimension: :func:`plan` reads both, and a mixed
or incomplete set is refused naming the layer. Each rule also states the shape of the tensor
below its stacked dimensions in terms of the arguments (:data:`SIZES`), so an argument that
contradicts a tensor is refused naming the argument.

Layer rules name the part after ``decoder.layers.``; Transformer Engine's fused names and the
local layer spec's separate norms are both listed (the local spec saves under the fused names).
Every model tensor of the checkpoint must be consumed by a rule, or the export is refused:
what a mapping does not cover is never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

COPY, VOCAB, QKV, GLU = "copy", "vocab", "qkv", "glu"
MODEL, LAYER, EXPERT = "model", "layer", "expert"
LAYERS = "decoder.layers."


@dataclass(frozen=True)
class Rule:
    """Megatron tensor (any of ``megatron``, the first present) -> HF tensors ``hf`` (``{i}``:
    the layer, ``{e}``: the expert), by operation ``op``, once per model, layer or expert.
    ``shape``: the tensor's shape below its stacked dimensions, in :data:`SIZES` names
    (``vocab``: at least the vocabulary); ``ffn``: the FFN size a ``glu`` splits."""

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    op: str = COPY
    scope: str = LAYER
    when: str | None = None  # only for a head that is not tied ("untied")
    shape: tuple[str, ...] = ()
    ffn: str = "ffn"


@dataclass(frozen=True)
class Family:
    """A model type's rules: ``rules`` for the model and every layer, ``dense``/``moe`` for the
    layers before / from ``Dims.dense_layers`` on, ``mtp`` for an MTP layer's own tensors
    (named after ``mtp.layers.{k}.``; its decoder layer's after ``transformer_layer.``)."""

    name: str  # model_type
    architecture: str
    rules: tuple[Rule, ...]
    dense: tuple[Rule, ...] = ()
    moe: tuple[Rule, ...] = ()
    mtp: tuple[Rule, ...] = ()


_ATTN = "model.layers.{i}.self_attn."
_QKV_W = (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight")
_COMMON = (
    Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), VOCAB, MODEL,
         shape=("vocab", "hidden")),
    Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), COPY, MODEL, shape=("hidden",)),
    Rule(("output_layer.weight",), ("lm_head.weight",), VOCAB, MODEL, when="untied", shape=("vocab", "hidden")),
    Rule(("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
         ("model.layers.{i}.input_layernorm.weight",), shape=("hidden",)),
    Rule(("self_attention.linear_qkv.weight",), _QKV_W, QKV, shape=("qkv", "hidden")),
    Rule(("self_attention.linear_proj.weight",), (_ATTN + "o_proj.weight",), shape=("hidden", "q")),
    Rule(("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
         ("model.layers.{i}.post_attention_layernorm.weight",), shape=("hidden",)),
)
_NORMS = tuple(r for r in _COMMON if r.scope == LAYER and r.op == COPY and r.shape == ("hidden",))
_MODEL = tuple(r for r in _COMMON if r.scope == MODEL)
_DENSE_MLP = (
    Rule(("mlp.linear_fc1.weight",), ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
         GLU, shape=("ffn2", "hidden")),
    Rule(("mlp.linear_fc2.weight",), ("model.layers.{i}.mlp.down_proj.weight",), shape=("hidden", "ffn")),
)
_QK_NORM = (
    Rule(("self_attention.q_layernorm.weight",), (_ATTN + "q_norm.weight",), shape=("head_dim",)),
    Rule(("self_attention.k_layernorm.weight",), (_ATTN + "k_norm.weight",), shape=("head_dim",)),
)
_FC1 = ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.local_experts.linear_fc1.weight")
_FC2 = ("mlp.experts.experts.linear_fc2.weight", "mlp.experts.local_experts.linear_fc2.weight")


def _experts(prefix: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    return (
        Rule(("mlp.router.weight",), (prefix + "gate.weight",), shape=("experts", "hidden")),
        Rule(_FC1, (prefix + gate, prefix + up), GLU, EXPERT, shape=("moe2", "hidden"), ffn="moe_ffn"),
        Rule(_FC2, (prefix + down,), COPY, EXPERT, shape=("hidden", "moe_ffn")),
    )


_MOE = "model.layers.{i}.block_sparse_moe."
_MLP = "model.layers.{i}.mlp."
# DeepSeek-V3's multi-latent attention: straight copies (TE fuses the latent norms into the up
# projections: both names listed); without q_lora_rank, one query projection.
_MLA = (
    Rule(("self_attention.linear_q_down_proj.weight",), (_ATTN + "q_a_proj.weight",), shape=("q_lora", "hidden"),
         when="q_lora"),
    Rule(("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
         (_ATTN + "q_a_layernorm.weight",), shape=("q_lora",), when="q_lora"),
    Rule(("self_attention.linear_q_up_proj.weight",), (_ATTN + "q_b_proj.weight",), shape=("q_mla", "q_lora"),
         when="q_lora"),
    Rule(("self_attention.linear_q_proj.weight",), (_ATTN + "q_proj.weight",), shape=("q_mla", "hidden"),
         when="no_q_lora"),
    Rule(("self_attention.linear_kv_down_proj.weight",), (_ATTN + "kv_a_proj_with_mqa.weight",),
         shape=("kv_a", "hidden")),
    Rule(("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
         (_ATTN + "kv_a_layernorm.weight",), shape=("kv_lora",)),
    Rule(("self_attention.linear_kv_up_proj.weight",), (_ATTN + "kv_b_proj.weight",), shape=("kv_b", "kv_lora")),
    Rule(("self_attention.linear_proj.weight",), (_ATTN + "o_proj.weight",), shape=("hidden", "o_mla")),
)
_DS_MOE = _experts(_MLP, "experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight",
                   "experts.{e}.down_proj.weight") + (
    Rule(("mlp.router.expert_bias",), (_MLP + "gate.e_score_correction_bias",), shape=("experts",)),
    Rule(("mlp.shared_experts.linear_fc1.weight",), (_MLP + "shared_experts.gate_proj.weight",
                                                      _MLP + "shared_experts.up_proj.weight"), GLU,
         shape=("shared2", "hidden"), ffn="shared"),
    Rule(("mlp.shared_experts.linear_fc2.weight",), (_MLP + "shared_experts.down_proj.weight",),
         shape=("hidden", "shared")),
)
_LAYER = "model.layers.{i}."
_MTP = (  # an MTP layer's own tensors, after mtp.layers.{k}.
    Rule(("enorm.weight",), (_LAYER + "enorm.weight",), shape=("hidden",)),
    Rule(("hnorm.weight",), (_LAYER + "hnorm.weight",), shape=("hidden",)),
    Rule(("eh_proj.weight",), (_LAYER + "eh_proj.weight",), shape=("hidden", "hidden2")),
    Rule(("final_layernorm.weight",), (_LAYER + "shared_head.norm.weight",), shape=("hidden",)),
)
FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", _COMMON + _DENSE_MLP),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _COMMON + _DENSE_MLP + (
        Rule(("self_attention.linear_qkv.bias",), tuple(n.replace(".weight", ".bias") for n in _QKV_W), QKV,
             shape=("qkv",)),)),
    "mixtral": Family("mixtral", "MixtralForCausalLM", _COMMON + _experts(
        _MOE, "experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight")),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", _COMMON + _QK_NORM + _DENSE_MLP),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", _COMMON + _QK_NORM, _DENSE_MLP, _experts(
        _MLP, "experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight")),
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3ForCausalLM", _MODEL + _NORMS + _MLA, _DENSE_MLP, _DS_MOE,
                          _MTP),
    "glm4_moe": Family("glm4_moe", "Glm4MoeForCausalLM", _COMMON + tuple(replace(r, when="qk_norm") for r in _QK_NORM) + (
        Rule(("self_attention.linear_qkv.bias",), tuple(n.replace(".weight", ".bias") for n in _QKV_W), QKV,
             shape=("qkv",)),), _DENSE_MLP, _DS_MOE, _MTP),
}
# The size names of Rule.shape: the Dims field (or product) each stands for, and the argument(s)
# it comes from, named when a tensor contradicts them.
SIZES = {
    "hidden": "hidden_size", "ffn": "ffn_hidden_size", "ffn2": "2 x ffn_hidden_size",
    "moe_ffn": "moe_ffn_hidden_size", "moe2": "2 x moe_ffn_hidden_size", "experts": "num_experts",
    "head_dim": "kv_channels", "q": "num_attention_heads x kv_channels",
    "qkv": "(num_attention_heads + 2 x num_query_groups) x kv_channels",
    "shared": "moe_shared_expert_intermediate_size", "shared2": "2 x moe_shared_expert_intermediate_size",
    "q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank", "kv_a": "kv_lora_rank + qk_pos_emb_head_dim",
    "q_mla": "num_attention_heads x (qk_head_dim + qk_pos_emb_head_dim)",
    "kv_b": "num_attention_heads x (qk_head_dim + v_head_dim)", "o_mla": "num_attention_heads x v_head_dim",
    "hidden2": "2 x hidden_size",
}


@dataclass(frozen=True)
class Dims:
    """The sizes a mapping needs (from the Megatron arguments, checked against the tensors)."""

    layers: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    tied: bool = False
    hidden: int = 0  # 0: not checked
    moe_ffn: int = 0
    shared: int = 0  # shared experts' FFN size
    dense_layers: int = 0  # the leading layers that take Family.dense (the others Family.moe)
    dense_ids: tuple[int, ...] = ()  # or these layers (Qwen3-MoE's mlp_only_layers), when given
    mtp: int = 0  # MTP layers exported (as layers layers + k)
    drop_mtp: bool = False  # --no-mtp: MTP tensors left out on purpose
    mla: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # q_lora, kv_lora, qk_head, qk_rope, v_head
    qk_norm: bool = True  # for a family whose QK norms are optional (when="qk_norm")

    def size(self, name: str) -> int:
        per_group = self.heads // self.groups if self.groups else 0
        q_lora, kv_lora, qk, rope, v = self.mla
        return {"hidden": self.hidden, "ffn": self.ffn, "ffn2": 2 * self.ffn, "moe_ffn": self.moe_ffn,
                "moe2": 2 * self.moe_ffn, "experts": self.experts, "head_dim": self.head_dim,
                "q": self.heads * self.head_dim, "qkv": self.groups * (per_group + 2) * self.head_dim,
                "shared": self.shared, "shared2": 2 * self.shared, "q_lora": q_lora, "kv_lora": kv_lora,
                "kv_a": kv_lora + rope, "q_mla": self.heads * (qk + rope), "kv_b": self.heads * (qk + v),
                "o_mla": self.heads * v, "hidden2": 2 * self.hidden}[name]


@dataclass(frozen=True)
class Slab:
    """Rows ``[start, stop)`` of dimension ``len(prefix)`` of Megatron tensor ``fqn`` at the
    fixed indices ``prefix``, with everything after; placed from row ``dst`` of the output."""

    fqn: str
    prefix: tuple[int, ...]
    start: int
    stop: int
    dst: int


@dataclass(frozen=True)
class Output:
    """One HF tensor: its name, shape and the slabs it is made of (in order)."""

    name: str
    shape: tuple[int, ...]
    slabs: tuple[Slab, ...]
    source: str  # the Megatron tensor, for messages and inspect


class MappingError(ValueError):
    """A tensor the mapping cannot take: the message says which and why."""


class Contradiction(MappingError):
    """A tensor whose shape contradicts what the arguments (or ``--config``) say: a size, the
    layer or expert count (verify's ``megatron.args_disagree``)."""


def _split(rule: Rule, rows: int, d: Dims, fqn: str) -> list[list[tuple[int, int]]]:
    """The row ranges of each output of ``rule.op`` over a slab of ``rows`` rows."""
    op = rule.op
    if op == COPY:
        return [[(0, rows)]]
    if op == VOCAB:
        if d.vocab > rows:
            raise Contradiction(f"{fqn} has {rows} rows, fewer than the vocabulary of {d.vocab}")
        return [[(0, d.vocab)]]
    if op == GLU:
        ffn = d.size(rule.ffn)
        if rows != 2 * ffn:
            raise Contradiction(f"{fqn} has {rows} rows; a gated MLP of FFN size {ffn} has {2 * ffn}")
        return [[(0, ffn)], [(ffn, 2 * ffn)]]
    per_group = d.heads // d.groups
    group_rows = (per_group + 2) * d.head_dim
    if rows != d.groups * group_rows:
        raise Contradiction(f"{fqn} has {rows} rows; {d.heads} heads in {d.groups} query groups of "
                           f"{d.head_dim} channels make {d.groups * group_rows}")
    q = [(g * group_rows, g * group_rows + per_group * d.head_dim) for g in range(d.groups)]
    k = [(a + per_group * d.head_dim, a + (per_group + 1) * d.head_dim) for a, _ in q]
    v = [(a + (per_group + 1) * d.head_dim, a + group_rows) for a, _ in q]
    return [q, k, v]


def check_shape(rule: Rule, fqn: str, shape: tuple[int, ...], d: Dims) -> None:
    """``shape`` (below the stacked dimensions) against ``rule.shape``: a mismatch names the
    arguments that say otherwise. Raises MappingError."""
    if not rule.shape:
        return
    if len(shape) != len(rule.shape):
        raise Contradiction(f"{fqn} has shape {list(shape)}; a {len(rule.shape)}-dimensional tensor was expected")
    for j, (got, name) in enumerate(zip(shape, rule.shape)):
        if name == "vocab":
            continue  # checked by the cut (at least the vocabulary)
        want = d.size(name)
        if name == "hidden" and not want:
            continue
        if got != want:
            raise Contradiction(f"{fqn} has {got} in dimension {j} of {list(shape)}, but the arguments say "
                               f"{SIZES[name]} = {want}")


def rule_outputs(rule: Rule, fqn: str, shape: tuple[int, ...], d: Dims, lead: tuple[int, ...] = (),
                 fmt: dict[str, int] | None = None) -> Iterator[Output]:
    """The HF tensors ``rule`` makes of Megatron tensor ``fqn`` (global ``shape``), whose leading
    ``len(lead)`` dimensions are stacked layers taken at ``lead`` (``()``: per-layer keys, and
    every layer of a stacked tensor when ``fmt`` is None). Raises MappingError when the shape
    does not fit the arguments."""
    if rule.scope != MODEL and fmt is None:  # a stacked tensor: every layer
        if not shape or shape[0] != d.layers:
            raise Contradiction(f"{fqn} stacks {shape[0] if shape else 0} layers; the arguments say {d.layers}")
        for i in range(d.layers):
            yield from rule_outputs(rule, fqn, shape, d, (i,), {"i": i})
        return
    fmt = fmt or {}
    k0 = len(lead)
    if rule.scope == EXPERT:
        if len(shape) <= k0 or shape[k0] != d.experts:
            raise Contradiction(f"{fqn} has shape {list(shape)}; the arguments say {d.experts} experts (num_experts)")
        prefixes = [(lead + (e,), {**fmt, "e": e}) for e in range(d.experts)]
    else:
        prefixes = [(lead, fmt)]
    k = len(prefixes[0][0])
    if len(shape) <= k:
        raise MappingError(f"{fqn} has shape {list(shape)}: no dimension left below the stacked ones")
    check_shape(rule, fqn, tuple(shape[k:]), d)
    rows, rest = shape[k], tuple(shape[k + 1:])
    parts = _split(rule, rows, d, fqn)
    if len(parts) != len(rule.hf):  # pragma: no cover - the tables are written to match
        raise MappingError(f"rule for {fqn} names {len(rule.hf)} outputs for {len(parts)} parts")
    for prefix, f in prefixes:
        for template, ranges in zip(rule.hf, parts):
            slabs, dst = [], 0
            for a, b in ranges:
                slabs.append(Slab(fqn, prefix, a, b, dst))
                dst += b - a
            yield Output(template.format(**f), (dst, *rest), tuple(slabs), fqn)


def split_layers(tensors: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], dict[int, set[str]]]:
    """The tensors outside per-layer keys, and per layer ``i`` the names after
    ``decoder.layers.{i}.`` (per-layer keys; ASCII digits only)."""
    rest: dict[str, tuple[int, ...]] = {}
    per: dict[int, set[str]] = {}
    for fqn, shape in tensors.items():
        if fqn.startswith(LAYERS):
            head, _, tail = fqn[len(LAYERS):].partition(".")
            if tail and head.isascii() and head.isdigit():
                per.setdefault(int(head), set()).add(tail)
                continue
        rest[fqn] = shape
    return rest, per


def _present(names: list[str], have: set[str] | dict[str, tuple[int, ...]], family: Family, where: str) -> str:
    present = [n for n in names if n in have]
    if not present:
        raise MappingError(f"{names[0]} is missing{where} (a {family.name} model has it)")
    if len(present) > 1:
        raise MappingError(f"both {present[0]} and {present[1]} are stored")
    return present[0]


def _applies(rule: Rule, d: Dims) -> bool:
    if rule.when == "q_lora":
        return bool(d.mla[0])
    if rule.when == "no_q_lora":
        return not d.mla[0]
    if rule.when == "qk_norm":
        return d.qk_norm
    return True


def _dense(d: Dims, i: int) -> bool:
    return i in d.dense_ids if d.dense_ids else i < d.dense_layers


def _layer_rules(family: Family, d: Dims, i: int) -> tuple[Rule, ...]:
    return tuple(r for r in family.rules + (family.dense if _dense(d, i) else family.moe)
                 if r.scope != MODEL and _applies(r, d))


def _check_layer_keys(per: dict[int, set[str]], stacked: dict[str, tuple[int, ...]], d: Dims) -> None:
    if not per:
        return
    layered = sorted(n for n in stacked if n.startswith(LAYERS))
    if layered:
        raise MappingError(f"both stacked ({layered[0]}) and per-layer (decoder.layers.{min(per)}.*) keys are stored")
    missing = [i for i in range(d.layers) if i not in per]
    if missing:
        raise Contradiction(f"layer {missing[0]} (decoder.layers.{missing[0]}.*) is missing; the arguments say "
                           f"{d.layers} layers (num_layers)")
    extra = sorted(i for i in per if i >= d.layers)
    if extra:
        raise Contradiction(f"decoder.layers.{extra[0]}.* is stored; the arguments say {d.layers} layers (num_layers)")


def plan(family: Family, tensors: dict[str, tuple[int, ...]], d: Dims) -> list[Output]:
    """Every HF tensor of ``family`` made from the model ``tensors`` (Megatron name -> global
    shape), with stacked or per-layer keys, and ``d.mtp`` MTP layers as layers ``d.layers + k``.
    Raises MappingError for a tensor a rule needs that is missing, a shape that does not fit, a
    mixed or incomplete set of per-layer keys, or a tensor no rule consumes."""
    out: list[Output] = []
    used: set[str] = set()
    stacked, per = split_layers(tensors)
    _check_layer_keys(per, stacked, d)
    for rule in family.rules:
        if rule.scope != MODEL:
            continue
        if rule.when == "untied" and d.tied:
            if any(n in tensors for n in rule.megatron):
                raise MappingError(f"{rule.megatron[0]} is stored, but the arguments say the output layer is tied to "
                                   "the embedding (untie_embeddings_and_output_weights false)")
            continue
        fqn = _present(list(rule.megatron), tensors, family, "")
        used.add(fqn)
        out.extend(rule_outputs(rule, fqn, tensors[fqn], d))
    if not per:  # stacked: one kind of layer throughout
        kinds = {_dense(d, i) for i in range(d.layers)}
        if family.dense and family.moe and len(kinds) > 1:
            raise MappingError("the layers are stacked, but the arguments say some are dense and the others MoE "
                               "(moe_layer_freq)")
        for rule in _layer_rules(family, d, 0 if kinds == {True} else d.layers):
            fqn = _present([LAYERS + n for n in rule.megatron], tensors, family, "")
            used.add(fqn)
            out.extend(rule_outputs(rule, fqn, tensors[fqn], d))
    else:
        for i in range(d.layers):
            kind = (", dense by moe_layer_freq" if _dense(d, i) else ", MoE by moe_layer_freq") if family.dense else ""
            for rule in _layer_rules(family, d, i):
                name = _present(list(rule.megatron), per[i], family, f" from layer {i}{kind}")
                fqn = f"{LAYERS}{i}.{name}"
                used.add(fqn)
                out.extend(rule_outputs(rule, fqn, tensors[fqn], d, (), {"i": i}))
    out.extend(_mtp(family, tensors, d, used))
    left = sorted(set(tensors) - used)
    if left:
        raise MappingError(f"{left[0]} is not covered by the {family.name} mapping"
                           + (f" ({len(left)} such tensors)" if len(left) > 1 else ""))
    return out


def _mtp(family: Family, tensors: dict[str, tuple[int, ...]], d: Dims, used: set[str]) -> list[Output]:
    """The MTP layers' tensors as HF layers ``d.layers + k`` (their own and their decoder
    layer's); with ``d.drop_mtp`` none, every ``mtp.`` tensor marked as left out on purpose."""
    if d.drop_mtp:
        used.update(n for n in tensors if n.startswith("mtp."))
        return []
    out: list[Output] = []
    for k in range(d.mtp):
        base, i = f"mtp.layers.{k}.", d.layers + k
        have = {n[len(base):] for n in tensors if n.startswith(base)}
        if not have:
            raise MappingError(f"MTP layer {k} ({base}*) is missing; the arguments say {d.mtp} (mtp_num_layers)")
        rules = [(r, "") for r in family.mtp] + [(r, "transformer_layer.") for r in _layer_rules(family, d, i)]
        for rule, sub in rules:
            name = _present([sub + n for n in rule.megatron], have, family, f" from MTP layer {k}")
            fqn = base + name
            used.add(fqn)
            out.extend(rule_outputs(rule, fqn, tensors[fqn], d, (), {"i": i}))
    return out
