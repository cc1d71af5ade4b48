"""The shortcuts the export and repair paths take at 90k tensors give what the long way gives:
the one-shard plan against huggingface_hub's grouping, the layer numbers of config agreement
read in one regex pass against name by name, and an export's bytes against safetensors' own
writer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors.torch import load_file, save_file

from ckptctl.api import export
from ckptctl.format.tensor import TensorSpec
from ckptctl.plan import group, make_plan
from ckptctl.resave.saves import _LAYER, _layer_numbers, config_mismatches
from ckptctl.write.options import ExportOptions
from tests.support import write_sharded


def _specs(n: int) -> list[TensorSpec]:
    return [TensorSpec(f"model.layers.{i % 7}.w{i}", ("BF16", "F32", "U8")[i % 3], (i % 5 + 1, 3)) for i in range(n)]


def test_one_shard_plan_is_the_hubs_grouping():
    specs = _specs(50)
    total = sum(s.nbytes for s in specs)
    split = split_state_dict_into_shards_factory({s.name: s.nbytes for s in specs}, get_storage_size=lambda n: n,
                                                 filename_pattern="{suffix}", max_shard_size=total)
    hub = list(split.filename_to_tensors.values())
    plan = make_plan(specs, max_shard_size=total)
    grouped = group(((s.name, s.nbytes) for s in specs), total)
    assert [[s.name for s in sh.specs] for sh in plan.shards] == hub == grouped
    assert plan.total_size == total and plan.total_parameters == sum(s.numel for s in specs)
    # one byte less: the hub's own grouping, as before
    smaller = make_plan(specs, max_shard_size=total - 1)
    regrouped = group(((s.name, s.nbytes) for s in specs), total - 1)
    assert [[s.name for s in sh.specs] for sh in smaller.shards] == regrouped
    assert len(smaller.shards) == 2


def test_layer_numbers_in_one_pass_equal_name_by_name():
    names = ["model.layers.3.blocks.5.x", "transformer.h.10.attn.w", "x.blocks.2.", "model.layers.12.mlp.experts.7.w",
             "lm_head.weight", "model.layers.x.1.", ".layers.7.", "m.layers.4.layers.9.a", "model.layers.07.a",
             "a.layers.5", "model.layers.61.eh_proj.weight", "é.layers.8.ü"]
    slow = {int(m.group(1)) for m in map(_LAYER.search, names) if m}
    assert _layer_numbers(names) == slow == {2, 3, 4, 7, 8, 10, 12, 61}
    hostile = names + ["broken\nmodel.layers.99.x", "x\n.h.5.y"]  # a name with a line break: name by name
    assert _layer_numbers(hostile) == {int(m.group(1)) for m in map(_LAYER.search, hostile) if m} == slow | {99, 5}
    assert _layer_numbers([]) == set()
    # the first match of a name is its leftmost whole match (a false start does not end the name)
    tricky = ["q.layers.1a.layers.6.b", "q.h.2.h.3.", "layers.4.x", "q.blocks..blocks.9.", "q.layers.5"]
    assert _layer_numbers(tricky) == {int(m.group(1)) for m in map(_LAYER.search, tricky) if m} == {6, 2, 9}
    # runs of names that share a layer's prefix, and names that share more than it
    runs = sorted(f"model.layers.{i}.{p}" for i in range(12) for p in ("a.w", "b.w", "mlp.experts.3.w"))
    runs += ["model.layers.1.h.2.x", "model.layers.1x.layers.4.y", "model.layers.1", "model.h.5.layers.6.z"]
    assert _layer_numbers(runs) == {int(m.group(1)) for m in map(_LAYER.search, runs) if m} == set(range(12)) | {5}
    tensors = {n: None for n in names}
    assert config_mismatches(tensors, {"num_hidden_layers": 8}) == 1  # the numbers are not 0..7
    assert config_mismatches({f"model.layers.{i}.w": None for i in range(4)}, {"num_hidden_layers": 4}) == 0


def test_export_of_many_small_tensors_is_safetensors_own_bytes(tmp_path: Path):
    """Thousands of tiny tensors in several source shards (runs coalesced across them) written
    into one shard: byte for byte what ``save_file`` writes for the same tensors."""
    g = torch.Generator().manual_seed(3)
    sd = {}
    for layer in range(12):
        for e in range(40):
            sd[f"model.layers.{layer}.mlp.experts.{e}.w"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
            sd[f"model.layers.{layer}.mlp.experts.{e}.scale"] = torch.rand(2, generator=g)
        sd[f"model.layers.{layer}.ids"] = torch.arange(layer, layer + 9, dtype=torch.int32)
    src = tmp_path / "src"
    write_sharded(src, sd, per_shard=97)
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 12}))
    res = export(src, tmp_path / "out", ExportOptions(manifest=True))
    assert res.bytes_streamed == 0 and res.bytes_copied_by_kernel + res.bytes_cloned == res.total_size
    save_file(sd, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["layers", "h", "blocks", "1", "2", "12", "x", "", "."]),
                         max_size=7).map(".".join), max_size=30))
def test_layer_numbers_by_runs_equal_name_by_name_for_any_names(names: list[str]) -> None:
    for order in (names, sorted(names)):
        assert _layer_numbers(order) == {int(m.group(1)) for m in map(_LAYER.search, order) if m}
