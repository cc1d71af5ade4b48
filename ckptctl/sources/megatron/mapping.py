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

Layer rules name the part after ``decoder.layers.``; Transformer Engine's fused names and the
local layer spec's separate norms are both listed (the local spec saves under the fused names).
Every model tensor of the checkpoint must be consumed by a rule, or the export is refused:
what a mapping does not cover is never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

COPY, VOCAB, QKV, GLU = "copy", "vocab", "qkv", "glu"
MODEL, LAYER, EXPERT = "model", "layer", "expert"
LAYERS = "decoder.layers."


@dataclass(frozen=True)
class Rule:
    """Megatron tensor (any of ``megatron``, the first present) -> HF tensors ``hf`` (``{i}``:
    the layer, ``{e}``: the expert), by operation ``op``, once per model, layer or expert."""

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    op: str = COPY
    scope: str = LAYER
    when: str | None = None  # only for a head that is not tied ("untied")


@dataclass(frozen=True)
class Family:
    name: str  # model_type
    architecture: str
    rules: tuple[Rule, ...]


_ATTN = "model.layers.{i}.self_attn."
_QKV_W = (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight")
_COMMON = (
    Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), VOCAB, MODEL),
    Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), COPY, MODEL),
    Rule(("output_layer.weight",), ("lm_head.weight",), VOCAB, MODEL, when="untied"),
    Rule(("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
         ("model.layers.{i}.input_layernorm.weight",)),
    Rule(("self_attention.linear_qkv.weight",), _QKV_W, QKV),
    Rule(("self_attention.linear_proj.weight",), (_ATTN + "o_proj.weight",)),
    Rule(("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
         ("model.layers.{i}.post_attention_layernorm.weight",)),
)
_DENSE_MLP = (
    Rule(("mlp.linear_fc1.weight",), ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
         GLU),
    Rule(("mlp.linear_fc2.weight",), ("model.layers.{i}.mlp.down_proj.weight",)),
)
_MOE = "model.layers.{i}.block_sparse_moe."
FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", _COMMON + _DENSE_MLP),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _COMMON + _DENSE_MLP + (
        Rule(("self_attention.linear_qkv.bias",), tuple(n.replace(".weight", ".bias") for n in _QKV_W), QKV),)),
    "mixtral": Family("mixtral", "MixtralForCausalLM", _COMMON + (
        Rule(("mlp.router.weight",), (_MOE + "gate.weight",)),
        Rule(("mlp.experts.experts.linear_fc1.weight", "mlp.experts.local_experts.linear_fc1.weight"),
             (_MOE + "experts.{e}.w1.weight", _MOE + "experts.{e}.w3.weight"), GLU, EXPERT),
        Rule(("mlp.experts.experts.linear_fc2.weight", "mlp.experts.local_experts.linear_fc2.weight"),
             (_MOE + "experts.{e}.w2.weight",), COPY, EXPERT),
    )),
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


def _split(op: str, rows: int, d: Dims, fqn: str) -> list[list[tuple[int, int]]]:
    """The row ranges of each output of ``op`` over a slab of ``rows`` rows."""
    if op == COPY:
        return [[(0, rows)]]
    if op == VOCAB:
        if d.vocab > rows:
            raise MappingError(f"{fqn} has {rows} rows, fewer than the vocabulary of {d.vocab}")
        return [[(0, d.vocab)]]
    if op == GLU:
        if rows != 2 * d.ffn:
            raise MappingError(f"{fqn} has {rows} rows; a gated MLP of FFN size {d.ffn} has {2 * d.ffn}")
        return [[(0, d.ffn)], [(d.ffn, 2 * d.ffn)]]
    per_group = d.heads // d.groups
    group_rows = (per_group + 2) * d.head_dim
    if rows != d.groups * group_rows:
        raise MappingError(f"{fqn} has {rows} rows; {d.heads} heads in {d.groups} query groups of "
                           f"{d.head_dim} channels make {d.groups * group_rows}")
    q = [(g * group_rows, g * group_rows + per_group * d.head_dim) for g in range(d.groups)]
    k = [(a + per_group * d.head_dim, a + (per_group + 1) * d.head_dim) for a, _ in q]
    v = [(a + (per_group + 1) * d.head_dim, a + group_rows) for a, _ in q]
    return [q, k, v]


def rule_outputs(rule: Rule, fqn: str, shape: tuple[int, ...], d: Dims) -> Iterator[Output]:
    """The HF tensors ``rule`` makes of Megatron tensor ``fqn`` (global ``shape``). Raises
    MappingError when the shape does not fit the arguments."""
    if rule.scope == MODEL:
        prefixes: list[tuple[tuple[int, ...], dict[str, int]]] = [((), {})]
    elif rule.scope == LAYER:
        if not shape or shape[0] != d.layers:
            raise MappingError(f"{fqn} stacks {shape[0] if shape else 0} layers; the arguments say {d.layers}")
        prefixes = [((i,), {"i": i}) for i in range(d.layers)]
    else:
        if len(shape) < 2 or shape[:2] != (d.layers, d.experts):
            raise MappingError(f"{fqn} has shape {list(shape)}; the arguments say {d.layers} layers of "
                               f"{d.experts} experts")
        prefixes = [((i, e), {"i": i, "e": e}) for i in range(d.layers) for e in range(d.experts)]
    k = len(prefixes[0][0])
    if len(shape) <= k:
        raise MappingError(f"{fqn} has shape {list(shape)}: no dimension left below the stacked ones")
    rows, rest = shape[k], tuple(shape[k + 1:])
    parts = _split(rule.op, rows, d, fqn)
    if len(parts) != len(rule.hf):  # pragma: no cover - the tables are written to match
        raise MappingError(f"rule for {fqn} names {len(rule.hf)} outputs for {len(parts)} parts")
    for prefix, fmt in prefixes:
        for template, ranges in zip(rule.hf, parts):
            slabs, dst = [], 0
            for a, b in ranges:
                slabs.append(Slab(fqn, prefix, a, b, dst))
                dst += b - a
            yield Output(template.format(**fmt), (dst, *rest), tuple(slabs), fqn)


def plan(family: Family, tensors: dict[str, tuple[int, ...]], d: Dims) -> list[Output]:
    """Every HF tensor of ``family`` made from the model ``tensors`` (Megatron name -> global
    shape). Raises MappingError for a tensor a rule needs that is missing, a shape that does not
    fit, or a tensor no rule consumes."""
    out: list[Output] = []
    used: set[str] = set()
    for rule in family.rules:
        names = [n if rule.scope == MODEL else LAYERS + n for n in rule.megatron]
        present = [n for n in names if n in tensors]
        if rule.when == "untied" and d.tied:
            if present:
                raise MappingError(f"{present[0]} is stored, but the arguments say the output layer is tied to "
                                   "the embedding (untie_embeddings_and_output_weights false)")
            continue
        if not present:
            raise MappingError(f"{names[0]} is missing (a {family.name} model has it)")
        if len(present) > 1:
            raise MappingError(f"both {present[0]} and {present[1]} are stored")
        fqn = present[0]
        used.add(fqn)
        out.extend(rule_outputs(rule, fqn, tensors[fqn], d))
    left = sorted(set(tensors) - used)
    if left:
        raise MappingError(f"{left[0]} is not covered by the {family.name} mapping"
                           + (f" ({len(left)} such tensors)" if len(left) > 1 else ""))
    return out
