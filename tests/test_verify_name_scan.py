"""The config rules' name scans (issue 16) read names exactly as their regular expressions do.

`_detect`, `_check_layers` and `containers` skip the regex for most names (a suffix filter, a
string split, a cache per container prefix). These tests hold each against the plain regex
reading it replaced, over names chosen to hit the regex's corners: a newline (`.` stops at it,
`$` allows one at the end), non-ASCII decimal digits (`\\d` is Unicode), empty layer suffixes,
nested containers, and prefixes that only look like a container."""

from __future__ import annotations

import random
import re

import pytest

from ckptctl.findings import PathFindings
from ckptctl.format.tensor import TensorSpec
from ckptctl.verify import model
from ckptctl.verify.architectures import LLAMA, SPECS, Dims
from ckptctl.verify.stacks import (EXPERT, EXPERT_RUNS, LAYER, LAYER_RUNS, check_experts, containers,
                                   expert_blocks)
from ckptctl.tensor_names import TensorNames

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


# --------------------------------------------------------------------------------------------
# the name table (issue 16): a pattern's run form over all names gives what the one-name regex
# gives name by name, whatever the order of the names and however they repeat a prefix

TOKENS = ["model", "layers", "layer", "h", "block", "blocks", "experts", "mlp", "0", "1", "12", "\u0663", "x",
          "gate", "weight", "", "a.h", "experts.3", "layers.2"]


def _random_names(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        out.append(".".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 7))))
    return out


def _run_orders(rng: random.Random) -> list[list[str]]:
    """Random names, the same names sorted (long runs of shared prefixes), hand-made runs whose
    later lines share the prefix of the first but read differently, and a DeepSeek-like table."""
    names = list(dict.fromkeys(_random_names(rng, 3000)))
    tricky = ["h.0.x", "h.0.a.layers.3.b", "h.0.", "h.0.layers.1.y", "m.h.0.x", "m.h.0.a.layers.3.b",
              "m.experts.1.w", "m.experts.1.experts.2.w", "m.experts.1.x", "m.experts.1.", "m.experts.1.experts.x.w",
              "m.experts.1.experts.2.", "m.experts.1.q.experts.4.w", "m.experts.1.r",
              "model.layers.4.", "model.layers.4.x", "model.layers.4.self_attn.q_proj.weight", "model.layers.4",
              "model.layers.45.x", "model.layers.4.mlp.down_proj.weight", "model.layers.4.mlp.down_proj.weightx"]
    deepseek = [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.{w}" for i in range(3, 6) for e in range(8)
                for p in ("down", "gate", "up") for w in ("weight", "weight_scale_inv")]
    deepseek += [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(6)]
    shuffled = names + tricky + deepseek
    rng.shuffle(shuffled)
    return [names, sorted(names), tricky, tricky[::-1], deepseek, shuffled, sorted(shuffled)]


def _by_one_name(pattern: re.Pattern[str], names: list[str], groups: tuple[int, ...]) -> set[tuple[str, ...]]:
    return {tuple(m.group(g) for g in groups) for n in names if (m := pattern.match(n))}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_runs_read_every_name_as_the_one_name_regex(seed: int) -> None:
    rng = random.Random(seed)
    for names in _run_orders(rng):
        for table in (TensorNames(_tensors(names)), TensorNames(_tensors(names + ["model.layers.9.x\n"]))):
            assert (table.text is None) == any("\n" in n for n in table.names)
            listed = table.names
            assert table.runs(LAYER_RUNS) == _by_one_name(LAYER, listed, (1, 2))
            assert table.runs(EXPERT_RUNS) == _by_one_name(EXPERT, listed, (1, 2))
            for subset in (listed, [n for n in listed if n.count(".experts.") <= 1]):  # the block runs' reading
                blocks: dict[str, set[int]] = {}
                for block, index in _by_one_name(EXPERT, subset, (1, 2)):
                    blocks.setdefault(block, set()).add(int(index))
                assert expert_blocks(TensorNames(_tensors(subset))) == blocks
            assert containers(table) == _containers_by_regex(table.tensors)
            indices, rules = model._layer_patterns("model.", LLAMA)
            assert table.runs(indices) == _by_one_name(re.compile(r"^model\.layers\.(\d+)\.(.+)$"), listed, (1,))
            suffixes = {r.suffix for r in LLAMA.rules}
            by_regex = [(n, m.group(2)) for n in listed
                        if (m := re.match(r"^model\.layers\.(\d+)\.(.+)$", n)) and m.group(2) in suffixes]
            assert [(n, m.group("suffix")) for n, m in table.matching(rules)] == by_regex
            for part in ("x", "weight", "h.0.x", ".weight_scale_inv", "experts.3"):
                assert table.ending(part) == [n for n in listed if n.endswith(part)]
                assert table.count_prefix(part) == sum(1 for n in listed if n.startswith(part))
            assert sorted(table.ending_any(("x", "weight", "0"))) == sorted(
                n for n in listed if n.endswith(("x", "weight", "0")))
            found = model._detect(table)
            assert (None if found is None else (found[0].name, found[1])) == _detect_by_regex(table.tensors)


def test_a_later_experts_segment_ends_a_run() -> None:
    """`m.experts.1.experts.2.w` shares the prefix `m.experts.1` of the name before it, but the
    regex reads it as expert 2 of block `m.experts.1.`: the run must stop there."""
    names = ["m.experts.1.w", "m.experts.1.experts.2.w", "m.experts.1.v"]
    assert expert_blocks(_tensors(names)) == {"m.": {1}, "m.experts.1.": {2}}
    # a bare container at the start is matched last: the next name's later container wins
    assert containers(_tensors(["h.0.x", "h.0.a.layers.3.b"])) == {"h": {0}}


def test_a_tie_between_two_roots_goes_to_the_first_in_order_whatever_the_hash_seed() -> None:
    """Two roots as strong as each other: every run must pick the same one, and a set's order
    changes with the hash seed."""
    import subprocess
    import sys
    code = ("from ckptctl.verify import model\nfrom ckptctl.tensor_names import TensorNames\n"
            "names = TensorNames.of_text('\\nb.layers.0.self_attn.q_proj.weight\\nb.embed_tokens.weight\\n'\n"
            "                            'a.layers.0.self_attn.q_proj.weight\\na.embed_tokens.weight\\n')\n"
            "print(model._detect(names)[1])\n")
    got = {subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=True).stdout.strip() for seed in range(12)}
    assert got == {"a."}
