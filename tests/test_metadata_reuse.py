"""Metadata read once per command (issue 16). read_index parses an index once per content: a
command scans the same directory several times, every read still reads the file, and what it
returns follows the bytes on disk. A plan that fits one shard is grouped without the hub, as
the hub groups it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptctl.format.index import read_index


def _write(path: Path, weight_map: dict[str, str], total: int) -> None:
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}), encoding="utf-8")


def test_a_rewrite_with_the_same_size_and_time_is_read_anew(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors.index.json"
    _write(p, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}, 10)
    first = read_index(p)
    st = os.stat(p)
    _write(p, {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}, 20)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the bytes differ
    assert os.stat(p).st_size == st.st_size
    second = read_index(p)
    assert first.weight_map == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    assert second.weight_map == {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}
    assert (first.metadata, second.metadata) == ({"total_size": 10}, {"total_size": 20})


def test_each_read_gets_its_own_maps_and_findings(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors.index.json"
    _write(p, {"a": "model-00001-of-00002.safetensors"}, 4)
    first = read_index(p, display="one")
    first.weight_map["x"] = "elsewhere"
    first.metadata["total_size"] = 0
    second = read_index(p, display="two")
    assert second.weight_map == {"a": "model-00001-of-00002.safetensors"}
    assert second.metadata == {"total_size": 4}
    assert second.path == "two" and second.findings == []
    # a broken index after a good one with the same length is reported, not served from before
    good = p.read_bytes()
    p.write_bytes(good[:-1] + b",")
    bad = read_index(p)
    assert [f.code for f in bad.findings] == ["index.bad_json"]
    assert bad.weight_map == {}


def test_one_shard_grouping_is_the_hubs() -> None:
    """plan.group answers "everything fits" without the hub: the same groups the hub returns."""
    from huggingface_hub import split_state_dict_into_shards_factory

    from ckptctl.plan import group

    for sizes, limit in (([("b", 4), ("a", 8), ("c", 0)], 12), ([("b", 4), ("a", 8), ("c", 1)], 12),
                         ([("x", 13)], 12), ([("x", 12)], 12), ([], 12), ([("a", 5), ("b", 5)], 10)):
        hub = split_state_dict_into_shards_factory(dict(sizes), get_storage_size=lambda s: s,
                                                   filename_pattern="{suffix}", max_shard_size=limit)
        assert group(sizes, limit) == list(hub.filename_to_tensors.values())


def test_duplicate_keys_name_the_first_repeat() -> None:
    """The JSON hook builds each object in one call and still names the key a key-by-key check
    stops at: the first key seen a second time."""
    from ckptctl.format.header import DuplicateKey, no_duplicate_keys

    assert no_duplicate_keys([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}
    assert no_duplicate_keys([]) == {}
    for pairs, key in (([("a", 1), ("b", 2), ("b", 3), ("a", 4)], "b"), ([("a", 1), ("b", 2), ("a", 3), ("b", 4)], "a"),
                       ([("x", 1), ("x", 1)], "x")):
        with pytest.raises(DuplicateKey) as exc:
            no_duplicate_keys(pairs)
        assert exc.value.key == key
