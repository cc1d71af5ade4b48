"""A keep-layout repair decides from the headers alone, before any record of a tensor is made,
whether there is anything to do: its decisions (total size, weight map, the nothing-to-do test)
are what the plan built from them says, for a sound checkpoint and for each kind of damage."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ckptctl import save_state_dict
from ckptctl.manifest import MANIFEST_NAME
from ckptctl.resave.analyze import analyze
from ckptctl.resave.keep import already_so, keep_layout_plan, kept_files, note_index_changes
from tests.support import state


def _sound(d: Path, single: bool = False) -> None:
    save_state_dict(state(1), d, max_shard_size="1GB" if single else "20KB", fsync=False)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32", "vocab_size": 64}))


def _trailing(d: Path) -> None:
    with open(d / "model-00002-of-00003.safetensors", "ab") as f:
        f.write(b"\0" * 100)


def _twice(d: Path) -> None:
    first = load_file(str(d / "model-00001-of-00003.safetensors"))
    extra = load_file(str(d / "model-00002-of-00003.safetensors"))
    extra[sorted(first)[0]] = first[sorted(first)[0]]
    save_file(extra, str(d / "model-00002-of-00003.safetensors"), metadata={"format": "pt"})


def _index(d: Path, change) -> None:
    p = d / "model.safetensors.index.json"
    doc = json.loads(p.read_text())
    change(doc)
    p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _moved(doc: dict) -> None:
    wm = doc["weight_map"]
    k = sorted(wm)[0]
    wm[k] = next(v for v in sorted(set(wm.values())) if v != wm[k])


DAMAGE = {
    "sound": None,
    "single": None,
    "trailing bytes": _trailing,
    "stored twice": _twice,
    "total_size": lambda d: _index(d, lambda doc: doc["metadata"].update(total_size=1)),
    "moved": lambda d: _index(d, _moved),
    "unindexed": lambda d: _index(d, lambda doc: doc["weight_map"].pop(sorted(doc["weight_map"])[-1])),
    "no index": lambda d: (d / "model.safetensors.index.json").unlink(),
    "manifest": lambda d: (d / MANIFEST_NAME).write_text("{}"),
    "stray file": lambda d: (d / "extra.safetensors").write_bytes((d / "model-00001-of-00003.safetensors").read_bytes()),
    "misnamed": lambda d: _misnamed(d),
}


def _misnamed(d: Path) -> None:
    """No index, and the shards numbered -of-00004 (renamed by the repair, linked)."""
    (d / "model.safetensors.index.json").unlink()
    for i in (1, 2, 3):
        os.rename(d / f"model-0000{i}-of-00003.safetensors", d / f"model-0000{i}-of-00004.safetensors")


def _plan_already_so(root: Path, chosen, plan, rep, weight_map) -> bool:
    """The nothing-to-do test as it was written on the plan."""
    from ckptctl import layout as L
    from ckptctl.write.superseded import superseded

    if rep.fixes or any(sp.link_from != str(root / sp.name) for sp in plan.shards):
        return False
    if plan.index_name != chosen.index_file:
        return False
    if plan.index_name is not None:
        old = chosen.index
        if old is None or old.metadata.get("total_size") != plan.total_size or old.weight_map != weight_map:
            return False
    dropped, _ = superseded(root, slot=L.slot_of(chosen.stem, chosen.variant), lay=chosen.layout)
    return set(dropped) <= set(plan.files) | {MANIFEST_NAME}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_decisions_from_the_headers_are_the_plans(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "c"
    _sound(d, single=damage == "single")
    if DAMAGE[damage] is not None:
        DAMAGE[damage](d)
    chosen, rep = analyze(d, repair=True)
    kf = kept_files(d, chosen, rep)
    plan, kept = keep_layout_plan(kf)
    assert kf.total_size == sum(s.data_bytes for s in plan.shards) == plan.total_size
    assert list(kf.weight_map.items()) == list(plan.weight_map.items())
    assert [p for p, _, _ in kept] == [str(d / n) for n in kf.files]
    if kf.index_name and chosen.index is not None:
        assert kf.same_map_as(chosen.index) == (chosen.index.weight_map == kf.weight_map)
        note_index_changes(chosen.index, kf, rep)
    noop = already_so(d, chosen, kf, rep)
    assert noop == _plan_already_so(d, chosen, plan, rep, plan.weight_map)
    assert noop == (damage in ("sound", "single", "manifest"))
