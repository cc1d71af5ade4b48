"""ckptctl/plan.py on its own (no files, no CLI): the grouping is huggingface_hub's, shard by
shard and in order, on random size lists; a tensor over the limit sits alone; names, totals,
metadata; and each shard's planned header plus its data is byte for byte what
``safetensors.torch.save_file`` writes for the same tensors.

End-to-end checks of the same rules through ``export`` are in test_export.py."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save

from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import TensorSpec
from ckptctl.plan import MAX_SHARDS, group, make_plan

_sizes = st.lists(st.integers(1, 600), min_size=1, max_size=40)
_limits = st.integers(1, 2_000)


def _u8_specs(sizes: list[int]) -> list[TensorSpec]:
    return [TensorSpec(f"t{i:03d}", "U8", (n,)) for i, n in enumerate(sizes)]


def _hub(sizes: list[int], limit: int) -> dict[str, list[str]]:
    """huggingface_hub's own split of uint8 tensors of these sizes (each with its own storage)."""
    sd = {f"t{i:03d}": torch.empty(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    return split_torch_state_dict_into_shards(sd, max_shard_size=limit).filename_to_tensors


@settings(max_examples=300, deadline=None)
@given(_sizes, _limits)
def test_plan_is_huggingface_hubs_split_shard_by_shard(sizes, limit):
    plan = make_plan(_u8_specs(sizes), max_shard_size=limit)
    ours = {sh.name: [s.name for s in sh.specs] for sh in plan.shards}
    hub = _hub(sizes, limit)
    assert list(ours.items()) == list(hub.items())  # the same files, in the same order, each in order
    assert plan.weight_map == {t: f for f, ts in hub.items() for t in ts}
    assert group(((f"t{i:03d}", n) for i, n in enumerate(sizes)), limit) == list(hub.values())


@settings(max_examples=200, deadline=None)
@given(_sizes, _limits)
def test_every_shard_is_within_the_limit_unless_one_tensor_alone_exceeds_it(sizes, limit):
    plan = make_plan(_u8_specs(sizes), max_shard_size=limit)
    for sh in plan.shards:
        assert sh.data_bytes <= limit or len(sh.specs) == 1
    assert sorted(s.name for sh in plan.shards for s in sh.specs) == [s.name for s in _u8_specs(sizes)]
    assert plan.total_size == sum(sizes) and plan.total_parameters == sum(sizes)


def test_an_oversize_tensor_goes_alone_before_the_shard_being_filled():
    # 6 starts a shard; 15 > 10 is appended at once, before it; 3 joins the 6; 4 would tip it over
    plan = make_plan(_u8_specs([6, 15, 3, 4]), max_shard_size=10)
    assert [[s.name for s in sh.specs] for sh in plan.shards] == [["t001"], ["t000", "t002"], ["t003"]]
    assert [sh.name for sh in plan.shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert plan.shards[0].data_bytes == 15 > 10  # alone, over the limit


def test_limits_are_inclusive():
    plan = make_plan(_u8_specs([5, 5, 5]), max_shard_size=10)
    assert [len(sh.specs) for sh in plan.shards] == [2, 1]


def test_one_shard_is_model_safetensors_without_an_index():
    plan = make_plan(_u8_specs([3, 4]), max_shard_size=100)
    assert [sh.name for sh in plan.shards] == ["model.safetensors"] and plan.index_name is None
    assert plan.files == ["model.safetensors"]


def test_names_use_the_prefix_and_five_digits():
    plan = make_plan(_u8_specs([4] * 12), max_shard_size=4, prefix="diffusion_pytorch_model")
    assert plan.shards[0].name == "diffusion_pytorch_model-00001-of-00012.safetensors"
    assert plan.shards[-1].name == "diffusion_pytorch_model-00012-of-00012.safetensors"
    assert plan.index_name == "diffusion_pytorch_model.safetensors.index.json"
    assert plan.files[-1] == plan.index_name and len(plan.files) == 13


def test_single_file_keeps_everything_in_one_shard_whatever_the_limit():
    plan = make_plan(_u8_specs([50, 50, 50]), max_shard_size=10, single_file=True)
    assert len(plan.shards) == 1 and plan.shards[0].name == "model.safetensors" and plan.index_name is None


def test_a_name_given_twice_is_refused_once_by_the_writer():
    """The plan is pure grouping; the writer's job makes the one duplicate-name check."""
    from ckptctl.errors import InputError
    from ckptctl.write.job import index_entries
    from ckptctl.sources.base import SourceTensor
    from ckptctl.write.inputs import Entry

    specs = _u8_specs([1]) + _u8_specs([2])
    with pytest.raises(InputError, match="'t000' is given twice"):
        index_entries([Entry(s, None, SourceTensor(s)) for s in specs])  # type: ignore[arg-type]


def test_more_shards_than_the_naming_allows_is_refused():
    with pytest.raises(ValueError, match="naming limit"):
        make_plan(_u8_specs([2] * (MAX_SHARDS + 1)), max_shard_size=1)


def test_metadata_goes_into_a_single_file_and_into_the_index_when_sharded():
    single = make_plan(_u8_specs([3]), max_shard_size=100, metadata={"label": "x"}, aliases={"tied": "t000"})
    assert single.shards[0].metadata == {"format": "pt", "label": "x", "tied": "t000"}
    assert single.aliases == {"tied": "t000"}
    sharded = make_plan(_u8_specs([3, 3]), max_shard_size=3, metadata={"label": "x"}, aliases={"tied": "t000"})
    assert [sh.metadata for sh in sharded.shards] == [{"format": "pt"}, {"format": "pt"}]
    # the user's metadata wins over an alias record of the same key
    clash = make_plan(_u8_specs([3]), max_shard_size=100, metadata={"tied": "mine"}, aliases={"tied": "t000"})
    assert clash.shards[0].metadata == {"format": "pt", "tied": "mine"}


def test_link_from_shards_are_not_counted_as_bytes_to_write():
    plan = make_plan(_u8_specs([10, 10, 10]), max_shard_size=10)
    assert plan.bytes_to_write == sum(sh.file_size for sh in plan.shards)
    plan.shards[1].link_from = "old-shard.safetensors"
    assert plan.bytes_to_write == plan.shards[0].file_size + plan.shards[2].file_size


# ---------------------------------------------------------------------------------------------
# header bytes: the planned file is safetensors' own file for the same tensors

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool,
           torch.float64, torch.int32]


@st.composite
def _state_dicts(draw):
    n = draw(st.integers(1, 12))
    names = draw(st.lists(st.text("abc._0123456789", min_size=1, max_size=12), min_size=n, max_size=n, unique=True))
    out = {}
    for i, name in enumerate(names):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        g = torch.Generator().manual_seed(i)
        out[name] = (torch.randint(0, 2, shape, generator=g) if dtype == torch.bool
                     else torch.randint(-100, 100, shape, generator=g)).to(dtype)
    return out


def _planned_file(shard, tensors: dict[str, torch.Tensor]) -> bytes:
    """The shard as the writer lays it out: the planned header, then each tensor's bytes at its
    planned offset."""
    data = bytearray(shard.data_bytes)
    for info in shard.layout:
        raw = tensors[info.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert len(raw) == info.end - info.begin
        data[info.begin:info.end] = raw
    return shard.header + bytes(data)


def _view(blob: bytes) -> tuple[int, list, bytes]:
    """(header length, top-level entries in file order, data). ``__metadata__`` is compared as a
    dict: safetensors writes it from a Rust HashMap, in a key order that is random per process."""
    (n,) = struct.unpack("<Q", blob[:8])
    pairs = json.loads(blob[8:8 + n], object_pairs_hook=list)
    return n, [(k, dict(v) if k == "__metadata__" else v) for k, v in pairs], blob[8 + n:]


@settings(max_examples=150, deadline=None)
@given(_state_dicts(), st.integers(16, 400), st.booleans())
def test_each_planned_shard_is_save_files_own_file(sd, limit, with_metadata):
    specs = [TensorSpec(k, dt.from_torch(v.dtype).name, tuple(v.shape)) for k, v in sd.items()]
    metadata = {"label": "run-1"} if with_metadata else None
    plan = make_plan(specs, max_shard_size=limit, metadata=metadata)
    for shard in plan.shards:
        tensors = {s.name: sd[s.name] for s in shard.specs}
        ours, theirs = _planned_file(shard, tensors), save(tensors, metadata=shard.metadata)
        assert _view(ours) == _view(theirs)
        if len(shard.metadata) == 1:  # one metadata key: no order to differ in, the very same bytes
            assert ours == theirs
        assert shard.file_size == len(theirs)
