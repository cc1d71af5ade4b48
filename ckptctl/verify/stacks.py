"""Layer stacks and MoE experts against config.json, for every architecture family.

transformers builds as many layers (and experts) as the config says and fills the ones the file
lacks with random values, with no error: a layer or an expert missing from the file is a silently
broken model. Extra layers beyond the config are silently dropped. These rules only read tensor
names, so they work for any family whose layers sit under ``<prefix>.<container>.<i>.``
(``layers``, ``layer``, ``h``, ``block``, ``blocks``), decoder-only, encoder-only and
encoder-decoder (per-stack counts: ``encoder_layers``/``decoder_layers``, T5's
``num_layers``/``num_decoder_layers``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckptctl.config_fields import ConfigFields, as_int
from ckptctl.findings import ERROR, INFO, PathFindings
from ckptctl.format.table import specs_of
from ckptctl.format.tensor import TensorSpec
from ckptctl.tensor_names import TensorNames, run_pattern

Tensors = Mapping[str, TensorSpec]

_CONTAINERS = "(?:layers|layer|h|block|blocks)"
LAYER = re.compile(rf"^((?:.*?\.)?{_CONTAINERS})\.(\d+)\.")
# LAYER over all names: (where, index). The lazy prefix tries every dot of the name before the
# bare container at its start, so a line that shares the prefix "where.index." gives the same
# groups only when the container was not matched at the start (``pre``): the run continues then.
LAYER_RUNS = run_pattern(rf"(?P<s>(?P<where>(?P<pre>.*?\.)?{_CONTAINERS})\.(?P<idx>\d+)\.)", r"[^\n]*",
                         r"(?(pre)(?:\n(?P=s)[^\n]*)*)", ("where", "idx"))
EXPERT = re.compile(r"^(.*\.)experts\.(\d+)\.(.+)$")
# EXPERT over all names, one (block, index) per run: the greedy prefix takes the last
# ".experts.N." of a name, so a line that shares "blockexperts.N" gives the same groups unless a
# later ".experts.N.x" follows, which every continued line is checked for.
_EXPERT = r"(?P<s>(?P<block>.*\.)experts\.(?P<idx>\d+))"
EXPERT_RUNS = run_pattern(_EXPERT, r"\..+$", r"(?:\n(?P=s)(?![^\n]*?\.experts\.\d+\.[^\n])\.[^\n]+)*",
                          ("block", "idx"))
# The fast reading, one match per block: lines "<block>experts.<N>.<rest>" of any N. Exact for a
# run whose every line holds ".experts." once (counted), where EXPERT_INDEX reads each line's N.
EXPERT_BLOCK_RUNS = run_pattern(r"(?P<s>(?P<block>.*\.)experts\.)\d+", r"\..+$", r"(?:\n(?P=s)\d+\.[^\n]+)*",
                                ("block",))
EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
# every place one starts: only ".experts." is consumed, so a ".experts.N." that begins at the
# dot after N is found too (the literal first part keeps the search fast)
EXPERT_INDEX_AT = re.compile(r"\.experts\.(?=(\d+)\.)")
# per-stack layer counts of encoder-decoder configs: stack -> field names, preferred first
STACK_FIELDS = {"encoder": ("encoder_layers", "num_layers", "num_hidden_layers"),
                "decoder": ("decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers")}
# a stack below a part naming one of these belongs to a sub-model (a vision or audio tower, a
# backbone, a speech pre-net) whose depth is in its own sub-config: not counted against the text
# model's fields, and said so in a note
SUBMODEL_PARTS = ("vision", "visual", "audio", "backbone", "image", "prenet", "postnet")
_SWAP = re.compile(r"(en|de)coder")
EXPERT_FIELDS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
# extra decoder layers the config declares beside num_hidden_layers (DeepSeek-V3/GLM multi-token prediction)
EXTRA_LAYER_FIELDS = ("num_nextn_predict_layers",)


def _first(items: list[int], total: int, shown: int = 10) -> str:
    """The first ``shown`` items, with ' ...' when there are more (``total`` of them)."""
    return ", ".join(map(str, items[:shown])) + (" ..." if total > shown else "")


def containers(tensors: "Tensors | TensorNames") -> dict[str, set[int]]:
    """Layer container prefix (``model.layers``) -> the layer indices that hold tensors. A container
    nested in a layer of another (T5's ``block.0.layer.1``) is not a stack of its own. Kept in
    the names' facts (read it, never change it)."""
    names = TensorNames.of(tensors)
    known = names.facts.get("containers")
    if known is not None:
        return known
    out: dict[str, set[int]] = {}
    for where, index in names.runs(LAYER_RUNS):
        got = out.get(where)
        if got is None:
            if LAYER.match(where + "."):
                continue  # nested
            got = out[where] = set()
        got.add(int(index))
    names.facts["containers"] = out
    return out


def count_findings(ctx: PathFindings, where: str, present: set[int], expected: int, field: str,
                   extra_allowed: int = 0) -> None:
    """``config.layer_missing`` / ``config.layer_extra`` for one stack: indices 0..expected-1 must
    all hold tensors; indices past ``expected + extra_allowed`` are ignored by the loader."""
    # never materialise range(expected): config.json is untrusted input
    n_missing = max(0, expected - sum(1 for i in present if i < expected))
    missing: list[int] = []
    i = 0
    while len(missing) < min(n_missing, 200):
        if i not in present:
            missing.append(i)
        i += 1
    extra = sorted(i for i in present if i >= expected + extra_allowed)
    if missing:
        ctx.add("config.layer_missing", ERROR,
                f"{field} is {expected} but {n_missing} layers have no tensors under {where}.N "
                f"(missing: {_first(missing, n_missing)}); they would be randomly initialised",
                f"restore the missing shard(s) or fix {field}", missing=missing[:200], stack=where)
    if extra:
        ctx.add("config.layer_extra", ERROR,
                f"{field} is {expected} but tensors exist for layers {_first(extra, len(extra))} under {where}.N; "
                "transformers silently ignores them",
                f"fix {field}, or drop the stale layers with ckptctl resave", extra=extra[:200], stack=where)


def _stack_of(where: str) -> tuple[str | None, bool]:
    """(``encoder`` or ``decoder`` when the container sits right in such a module, e.g.
    ``model.encoder.layers``, SpeechT5's ``encoder.wrapped_encoder.layers``; whether it belongs to a
    sub-model: :data:`SUBMODEL_PARTS`)."""
    parts = where.split(".")
    parent = parts[-2] if len(parts) > 1 else ""
    sub = any(m in p for p in parts[:-1] for m in SUBMODEL_PARTS)
    return next((s for s in ("encoder", "decoder") if parent.endswith(s)), None), sub


def check_stacks(ctx: PathFindings, cfg: dict, tensors: "Tensors | TensorNames", *, skip: str | None = None) -> bool:
    """Every layer stack against its count in the config: the text model's stack against
    ``num_hidden_layers``, an encoder-decoder's encoder and decoder stacks against their own
    fields. A stack whose depth no field these rules know gives (a sub-model's, or one beside an
    encoder-decoder's two) is not counted, and one note names them. ``skip``: a container the
    caller has already checked. Returns whether any stack was checked."""
    c = ConfigFields(cfg)
    stacks = {k: v for k, v in containers(tensors).items() if k != skip}
    checked = False
    enc_dec = bool(cfg.get("is_encoder_decoder"))
    if enc_dec:  # a stack whose every layer is gone is still a stack: its sibling names it
        for where in list(stacks):
            stack, sub = _stack_of(where)
            if stack is not None and not sub:
                sibling = _SWAP.sub(lambda m: "decoder" if m.group(1) == "en" else "encoder", where)
                stacks.setdefault(sibling, set())
    extra_allowed = sum(as_int(c.get(f)) or 0 for f in EXTRA_LAYER_FIELDS)
    unknown: list[str] = []
    for where, present in sorted(stacks.items()):
        stack, sub = _stack_of(where)
        if sub or (enc_dec and stack is None):
            unknown.append(where)
            continue
        fields = STACK_FIELDS[stack] if enc_dec and stack is not None else ("num_hidden_layers",)
        field, expected = next(((f, v) for f in fields if (v := as_int(c.get(f))) is not None), (None, None))
        if expected is None or expected < 0:
            continue
        count_findings(ctx, where, present, expected, field, extra_allowed if not enc_dec else 0)
        checked = True
    if unknown:
        mt = cfg.get("model_type")
        ctx.add("config.not_checked", INFO,
                f"{ctx.path}: layer stacks whose depth is not a config field these rules know (a sub-model's, "
                f"model_type {mt!r}): {_first(unknown, len(unknown), 4)}; their layer counts not checked",
                stacks=unknown[:20])
    return checked


def expert_blocks(tensors: "Tensors | TensorNames") -> dict[str, set[int]]:
    """Expert block prefix (``model.layers.3.mlp.``) -> the expert indices that hold tensors. Kept
    in the names' facts (read it, never change it)."""
    names = TensorNames.of(tensors)
    known = names.facts.get("expert_blocks")
    if known is None:
        known = names.facts["expert_blocks"] = _expert_blocks(names)
    return known


def _expert_blocks(names: TensorNames) -> dict[str, set[int]]:
    text = names.text
    per_block: dict[str, set[int]] = {}
    if text is not None:
        if ".experts." not in text:  # every EXPERT match holds it
            return per_block
        runs = [(m.group("block"), m.start(), m.end()) for m in EXPERT_BLOCK_RUNS.run.finditer(text)]
        # every line of a run holds ".experts.N." where its block ends: when a run has as many
        # places where one starts as lines (overlapping ones counted), that is each line's only
        # one, and its N is the line's expert
        found = [EXPERT_INDEX_AT.findall(text, a, b) for _, a, b in runs]
        if all(len(f) == text.count("\n", a, b) for f, (_, a, b) in zip(found, runs)):
            for (block, _, _), f in zip(runs, found):
                per_block.setdefault(block, set()).update(map(int, set(f)))
            return per_block
    for block, index in names.runs(EXPERT_RUNS):
        per_block.setdefault(block, set()).add(int(index))
    return per_block


def check_experts(ctx: PathFindings, cfg: dict, tensors: "Tensors | TensorNames") -> None:
    """MoE: every layer that has experts has all of them, and the router's rows equal the count."""
    c = ConfigFields(cfg)
    field, n = next(((f, v) for f in EXPERT_FIELDS if (v := as_int(c.get(f))) is not None), (None, None))
    names = TensorNames.of(tensors)
    per_block = expert_blocks(names)
    if not per_block:
        return
    if n is None:
        ctx.add("config.not_checked", INFO, f"{ctx.path}: experts found but no expert count in the config "
                f"({', '.join(EXPERT_FIELDS)}); expert checks skipped")
        return
    missing = {blk: sorted(set(range(min(n, 1 << 16))) - got) for blk, got in per_block.items()}
    missing = {blk: m for blk, m in missing.items() if m}
    extra = {blk: sorted(i for i in got if i >= n) for blk, got in per_block.items()}
    extra = {blk: e for blk, e in extra.items() if e}
    for blk, m in sorted(missing.items()):
        ctx.add("config.expert_missing", ERROR,
                f"{field} is {n} but {blk}experts.N has no tensors for experts {_first(m, len(m))}; transformers "
                "initialises them randomly and the router still sends tokens to them",
                "restore the missing shard(s), or fix the expert count in config.json", block=blk, missing=m[:200])
    for blk, e in sorted(extra.items()):
        ctx.add("config.expert_count", ERROR,
                f"{field} is {n} but {blk}experts.N holds experts {_first(e, len(e))}; transformers silently "
                "ignores them", f"fix {field} in config.json", block=blk, extra=e[:200])
    gates = specs_of(names.tensors, [blk + "gate.weight" for blk in per_block])
    for blk in sorted(per_block):
        gate = gates.get(blk + "gate.weight")
        if gate is not None and len(gate.shape) == 2 and gate.shape[0] != n:
            ctx.add("config.expert_count", ERROR,
                    f"router {gate.name!r} scores {gate.shape[0]} experts but {field} is {n}: loading fails with a "
                    "size mismatch, or the model routes to the wrong experts",
                    f"fix {field} in config.json", tensor=gate.name, rows=gate.shape[0], experts=n)
