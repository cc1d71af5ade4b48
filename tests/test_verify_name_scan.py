"""The config rules' name scans (issue 16) read names exactly as their regular expressions do.

`_detect`, `_check_layers` and `containers` skip the regex for most names (a suffix filter, a
string split, a cache per container prefix). These tests hold each against the plain regex
reading it replaced, over names chosen to hit the regex's corners: a newline (`.` stops at it,
`$` allows one at the end), non-ASCII decimal digits (`\\d` is Unicode), empty layer suffixes,
nested containers, and prefixes that only look like a container."""

from __future__ import annotations

import re

import pytest

from ckptctl.findings import PathFindings
from ckptctl.format.tensor import TensorSpec
from ckptctl.verify import model
from ckptctl.verify.architectures import LLAMA, SPECS, Dims
from ckptctl.verify.stacks import LAYER, check_experts, containers

TRICKY = [
    "model.embed_tokens.weight", "embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.q_proj.weight\n",
    "model.layers.3.self_attn.q_proj.weight\nx", "model.layers.4.\n", "model.layers.5.",
    "model.layers.5.x\n", "model.layers.\u0663.self_attn.q_proj.weight", "model.layers.\u00b2.mlp.x",
    "model.layers.x.mlp.y", "model.layers..mlp", "model.layers.7", "model.layers.8.a.b.c",
    "model.mylayers.9.self_attn.q_proj.weight", "a\nb.layers.10.self_attn.q_proj.weight",
    "transformer.h.0.attn.c_attn.weight", "transformer.wte.weight", "transformer.graph.0.attn.c_attn.weight",
    "encoder.block.0.layer.1.DenseReluDense.wi.weight", "encoder.block.1.layer.0.SelfAttention.q.weight",
    "decoder.block.0.layer.2.x", "vision.blocks.3.attn.qkv.weight", "gpt_neox.embed_in.weight",
    "gpt_neox.layers.0.attention.query_key_value.weight", "h.0.x", "layer.0.", "layers.0.\n",
    "model.layers.11.mlp.experts.3.w1.weight", "model.layers.11.mlp.experts.\u0663.w1.weight",
    "model.layers.11.mlp.experts.4.\n", "model.layers.11.mlp.experts.x.w1", "experts.1.w",
]


def _tensors(names: list[str]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(n, "BF16", (4, 4)) for n in names}


def _detect_by_regex(tensors: dict[str, TensorSpec]):
    """`_detect` as it was: every layout's regex over every name."""
    best = None
    names = list(tensors)
    for spec in SPECS:
        roots: set[str] = set()
        for n in names:
            if n == spec.embed or n.endswith("." + spec.embed):
                roots.add(n[: len(n) - len(spec.embed)])
        pat = re.compile(rf"^(.*?){spec.layer}\.\d+\.{re.escape(spec.rules[0].suffix)}$")
        for n in names:
            m = pat.match(n)
            if m:
                roots.add(m.group(1))
        for root in sorted(roots):
            hits = sum(1 for n in names if n.startswith(root + spec.layer + "."))
            score = hits + (1 << 40 if (root + spec.embed) in tensors else 0)
            if hits and (best is None or score > best[0]):
                best = (score, spec, root)
    return (best[1].name, best[2]) if best else None


def _containers_by_regex(tensors: dict[str, TensorSpec]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for n in tensors:
        m = LAYER.match(n)
        if m and not LAYER.match(m.group(1) + "."):
            out.setdefault(m.group(1), set()).add(int(m.group(2)))
    return out


@pytest.mark.parametrize("drop", [None, "model.embed_tokens.weight", "transformer.wte.weight"])
def test_detect_finds_the_layout_and_root_the_regexes_find(drop: str | None) -> None:
    names = [n for n in TRICKY if n != drop]
    for subset in (names, [n for n in names if not n.startswith("model.")],
                   [n for n in names if "\n" in n or n.startswith("gpt_neox")]):
        found = model._detect(_tensors(subset))
        assert (None if found is None else (found[0].name, found[1])) == _detect_by_regex(_tensors(subset))
    # the trailing-newline name is a layer hit for the regex, and so for the scan
    assert model._detect(_tensors(["x.layers.2.self_attn.q_proj.weight\n"])) == (LLAMA, "x.")


def test_containers_match_the_regex_reading() -> None:
    tensors = _tensors(TRICKY)
    assert containers(tensors) == _containers_by_regex(tensors)
    assert "encoder.block" in containers(tensors) and "encoder.block.0.layer" not in containers(tensors)


def test_layer_scan_reads_indices_and_suffixes_as_the_regex_does() -> None:
    """`_check_layers` with a config whose layer count and down_proj shape tensors break: the
    layers it counts and the tensors it flags are the regex's."""
    tensors = _tensors(TRICKY)
    bad_name = "model.layers.1.mlp.down_proj.weight"
    tensors[bad_name] = TensorSpec(bad_name, "BF16", (8, 4))
    tensors["model.layers.9.mlp.down_proj.weight\n"] = TensorSpec("model.layers.9.mlp.down_proj.weight\n", "BF16", (8, 4))
    dims = Dims(hidden=4, heads=2, kv=2, head_dim=2, inter=4, layers=30)
    ctx = PathFindings("x")
    model._check_layers(ctx, LLAMA, "model.", dims, tensors, False, 0)
    pat = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    present = sorted({int(m.group(1)) for n in tensors if (m := pat.match(n))})
    missing = [f for f in ctx.findings if f.code == "config.layer_missing"]
    assert len(missing) == 1
    assert missing[0].details["missing"] == [i for i in range(30) if i not in present]
    bad = [f for f in ctx.findings if f.code != "config.layer_missing"]
    # the regex reads the newline name as layer 9's down_proj too ('$' before a final newline)
    assert [f.tensor for f in bad] == [bad_name]
    assert bad[0].details["count"] == 2


def test_experts_prefilter_keeps_every_regex_match() -> None:
    ctx = PathFindings("x")
    check_experts(ctx, {"n_routed_experts": 6}, _tensors(TRICKY))
    blocks = {f.details["block"]: f.details["missing"] for f in ctx.findings if f.code == "config.expert_missing"}
    # experts 3 (ASCII and Arabic-Indic digit) only: '.+' takes no lone newline, 'x' is no index
    assert blocks == {"model.layers.11.mlp.": [0, 1, 2, 4, 5]}
