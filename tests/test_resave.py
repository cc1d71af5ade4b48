"""resave: re-shard, re-type and repair in place; zero-copy; refusals; kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptctl import save_state_dict
from tests.support import load_hub, run_ckptctl, same, staging_dirs, state
from tests.support import load_glob as load_dir


def _ckpt(d: Path, sd=None, shard="20KB", config=True) -> dict:
    sd = sd or state(1)
    save_state_dict(sd, d, max_shard_size=shard, fsync=False)
    if config:
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32",
                                                   "vocab_size": 64}))
    return sd


def _inodes(d: Path) -> dict[str, int]:
    return {n: os.stat(d / n).st_ino for n in os.listdir(d)}


def _snapshot(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d)) if (d / n).is_file()}


def _ok(d: Path, sd: dict) -> None:
    assert same(load_dir(d), sd) and same(load_hub(d), sd)
    assert staging_dirs(d.parent) == []
    # the oracle is verify (the result must verify clean), not inspect
    from ckptctl.verify import verify_paths

    report = verify_paths([str(d)])
    assert not report.failed(), [(f.code, f.message) for f in report.findings]


def test_reshard_in_place(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    assert len(list(d.glob("model-*"))) == 3
    p = run_ckptctl("resave", str(d), "--max-shard-size", "1GB", "--json")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]
    _ok(d, sd)
    doc = json.loads(p.stdout)
    assert doc["bytes_copied_by_kernel"] == sum(t.numel() * 4 for t in sd.values()) and doc["bytes_streamed"] == 0


def test_dtype_change_syncs_config(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    run_ckptctl("resave", str(d), "--dtype", "bf16", check=True)
    _ok(d, {k: v.bfloat16() for k, v in sd.items()})
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_resave_without_changes_links_every_shard(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    before = _inodes(d)
    p = run_ckptctl("resave", str(d), "--max-shard-size", "20KB", "--json")
    doc = json.loads(p.stdout)
    assert doc["bytes_copied_by_kernel"] == 0 and doc["bytes_streamed"] == 0
    assert len(doc["linked"]) == 3
    after = _inodes(d)
    assert all(after[n] == before[n] for n in before if n.startswith("model-"))
    _ok(d, sd)


# --- repairs -----------------------------------------------------------------------------------

def _repair(d: Path, *extra: str) -> dict:
    p = run_ckptctl("resave", "--repair", str(d), "--json", *extra)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_repair_stale_index_beside_single_file(tmp_path):
    d = tmp_path / "c"
    _ckpt(d)
    for f in d.glob("model-*"):
        f.unlink()  # what transformers leaves: a single file saved over a sharded one
    new = state(2)
    save_file(new, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert run_ckptctl("resave", str(d)).returncode == 2  # refuses to act without --repair
    doc = _repair(d)
    assert doc["bytes_streamed"] == 0 and doc["bytes_copied_by_kernel"] == 0
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]
    _ok(d, new)


def test_repair_stale_single_file_beside_index_uses_config(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d, {**state(1), "embed_tokens.weight": torch.randn(64, 8)})
    save_file({"embed_tokens.weight": torch.randn(50, 8)}, str(d / "model.safetensors"))  # wrong vocab
    _repair(d)
    assert "model.safetensors" not in os.listdir(d)
    _ok(d, sd)


def test_both_complete_needs_prefer(tmp_path):
    d = tmp_path / "c"
    _ckpt(d, config=False)
    save_file(state(9), str(d / "model.safetensors"))
    before = _snapshot(d)
    p = run_ckptctl("resave", "--repair", str(d))
    assert p.returncode == 2 and "--prefer" in p.stderr and _snapshot(d) == before
    _repair(d, "--prefer", "single")
    _ok(d, state(9))


def test_repair_rebuilds_missing_or_wrong_index(tmp_path):
    for damage in ("missing", "garbage", "total_size", "dropped_tensor", "wrong_shard"):
        d = tmp_path / damage
        sd = _ckpt(d)
        idx_path = d / "model.safetensors.index.json"
        idx = json.loads(idx_path.read_text())
        if damage == "missing":
            idx_path.unlink()
        elif damage == "garbage":
            idx_path.write_text("{not json")
        elif damage == "total_size":
            idx["metadata"]["total_size"] = 1
            idx_path.write_text(json.dumps(idx))
        elif damage == "dropped_tensor":
            del idx["weight_map"]["layer.0.weight"]
            idx_path.write_text(json.dumps(idx))
        else:
            idx["weight_map"]["layer.0.weight"] = "model-00003-of-00003.safetensors"
            idx_path.write_text(json.dumps(idx))
        before = _inodes(d)
        doc = _repair(d)
        assert doc["bytes_streamed"] == 0 and doc["bytes_copied_by_kernel"] == 0, damage
        assert all(_inodes(d)[n] == before[n] for n in before if n.startswith("model-0")), damage
        _ok(d, sd)
        assert json.loads(idx_path.read_text())["metadata"]["total_size"] == sum(t.numel() * 4 for t in sd.values())


def test_repair_removes_unreferenced_shards_and_leftovers(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    shutil.copy(d / "model-00001-of-00003.safetensors", d / "model-00001-of-00004.safetensors")
    (d / "model-00002-of-?????.safetensors").write_bytes(b"partial")
    (d / ".tmpXyZ123").write_bytes(b"x")
    (d / "_tmp_x.0123456789abcdef-0123abcd").mkdir()  # named exactly like a ckptctl staging dir
    (d / "_tmp_old").mkdir()  # a user's folder: not provably anybody's leftover, so it stays
    (d / "x.incomplete").write_bytes(b"")
    (d / "notes.md").write_text("mine")
    _repair(d)
    assert sorted(os.listdir(d)) == ["_tmp_old", "config.json", "model-00001-of-00003.safetensors",
                                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                                     "model.safetensors.index.json", "notes.md"]
    _ok(d, sd)


def test_repair_renames_wrong_of_n_names_without_copying(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    (d / "model.safetensors.index.json").unlink()
    (d / "model-00003-of-00003.safetensors").unlink()  # a 2-of-3 family would be unrepairable...
    # ...so build a consistent 2-shard family named -of-00005
    sd2 = {k: v for k, v in sd.items() if idx["weight_map"][k] != "model-00003-of-00003.safetensors"}
    os.rename(d / "model-00001-of-00003.safetensors", d / "model-00001-of-00005.safetensors")
    os.rename(d / "model-00002-of-00003.safetensors", d / "model-00002-of-00005.safetensors")
    ino = os.stat(d / "model-00001-of-00005.safetensors").st_ino
    doc = _repair(d)
    assert doc["bytes_streamed"] == 0 and doc["bytes_copied_by_kernel"] == 0
    assert os.stat(d / "model-00001-of-00002.safetensors").st_ino == ino
    _ok(d, sd2)


def test_repair_tensor_stored_twice(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    first = load_file(str(d / "model-00001-of-00003.safetensors"))
    name = sorted(first)[0]
    extra = load_file(str(d / "model-00002-of-00003.safetensors"))
    extra[name] = first[name]
    save_file(extra, str(d / "model-00002-of-00003.safetensors"), metadata={"format": "pt"})
    _repair(d)
    _ok(d, sd)
    # different bytes: refused, nothing changed
    d2 = tmp_path / "c2"
    _ckpt(d2)
    extra = load_file(str(d2 / "model-00002-of-00003.safetensors"))
    extra[name] = first[name] + 1
    save_file(extra, str(d2 / "model-00002-of-00003.safetensors"), metadata={"format": "pt"})
    before = _snapshot(d2)
    p = run_ckptctl("resave", "--repair", str(d2))
    assert p.returncode == 1 and "different contents" in p.stderr and _snapshot(d2) == before


def test_repair_trailing_bytes(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    with open(d / "model-00002-of-00003.safetensors", "ab") as f:
        f.write(b"\0" * 100)
    doc = _repair(d)
    assert doc["bytes_copied_by_kernel"] == 16384  # only that shard's tensors are copied
    _ok(d, sd)


def test_repair_second_family_with_prefer(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    torch.save(state(8), d / "pytorch_model.bin")
    p = run_ckptctl("resave", "--repair", str(d))
    assert p.returncode == 2 and "--prefer" in p.stderr
    _repair(d, "--prefer", "safetensors")
    assert "pytorch_model.bin" not in os.listdir(d)
    _ok(d, sd)
    d2 = tmp_path / "c2"
    _ckpt(d2)
    torch.save(state(8), d2 / "pytorch_model.bin")
    _repair(d2, "--prefer", "pytorch")
    _ok(d2, state(8))


@pytest.mark.parametrize("damage", ["truncated", "missing_shard", "corrupt_header"])
def test_unrepairable_is_refused_untouched(tmp_path, damage):
    d = tmp_path / "c"
    _ckpt(d)
    f = d / "model-00002-of-00003.safetensors"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif damage == "missing_shard":
        f.unlink()
    else:
        raw = bytearray(f.read_bytes())
        raw[8:12] = b"\xff\xfe\x00\x01"
        f.write_bytes(bytes(raw))
    before = _snapshot(d)
    p = run_ckptctl("resave", "--repair", str(d))
    assert p.returncode == 1, p.stderr
    assert "error:" in p.stderr and "nothing was changed" in p.stderr and "Traceback" not in p.stderr
    assert _snapshot(d) == before and staging_dirs(tmp_path) == []


def test_output_elsewhere_and_dry_run(tmp_path):
    d = tmp_path / "c"
    sd = _ckpt(d)
    before = _snapshot(d)
    p = run_ckptctl("resave", str(d), "--max-shard-size", "1GB", "--dry-run", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["dry_run"] and _snapshot(d) == before
    run_ckptctl("resave", str(d), "--output", str(tmp_path / "o"), "--dtype", "fp16", check=True)
    assert _snapshot(d) == before
    _ok(tmp_path / "o", {k: v.half() for k, v in sd.items()})
    assert json.loads((tmp_path / "o" / "config.json").read_text())["torch_dtype"] == "float16"


KILL_POINTS = ["stage-created", "write-data", "shards-written", "extras-written", "sealed", "publish", "published"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill9_during_resave_leaves_old_or_new(tmp_path, point):
    d = tmp_path / "c"
    sd = _ckpt(d)
    p = run_ckptctl("resave", str(d), "--max-shard-size", "1GB", "--dtype", "bf16",
                    env={"CKPTCTL_KILL_AT": point})
    assert p.returncode == -signal.SIGKILL
    got = load_dir(d)
    assert same(got, load_hub(d))
    if point == "published":
        assert same(got, {k: v.bfloat16() for k, v in sd.items()})
    else:
        assert same(got, sd)
    run_ckptctl("resave", str(d), "--max-shard-size", "1GB", "--dtype", "bf16", check=True)
    _ok(d, {k: v.bfloat16() for k, v in sd.items()})


def test_a_finding_repair_cannot_fix_is_refused_not_looped(tmp_path):
    """resave says "needs repair"; --repair must not then answer "nothing to repair" (a loop): it
    refuses with the finding's own next step and changes nothing."""
    d = tmp_path / "c"
    _ckpt(d, shard="1GB")
    save_file({"lora": torch.ones(2)}, str(d / "adapter_model.safetensors"))  # no adapter_config.json
    before = {n: (d / n).stat().st_ino for n in os.listdir(d)}
    proc = run_ckptctl("resave", d)
    assert proc.returncode == 2 and "needs repair" in proc.stderr and "adapter_config.json" in proc.stderr
    proc = run_ckptctl("resave", "--repair", d)
    assert proc.returncode == 1, proc.stderr
    assert "no certain fix" in proc.stderr and "copy the adapter_config.json" in proc.stderr
    assert "nothing to repair" not in proc.stdout + proc.stderr
    assert {n: (d / n).stat().st_ino for n in os.listdir(d)} == before


def test_repair_of_a_sound_sharded_checkpoint_writes_nothing(tmp_path):
    d = tmp_path / "c"
    _ckpt(d)
    before = {n: ((d / n).stat().st_ino, (d / n).read_bytes()) for n in os.listdir(d)}
    proc = run_ckptctl("resave", "--repair", "--json", d)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and doc["unchanged"] is True and doc["publish"] is None
    assert {n: ((d / n).stat().st_ino, (d / n).read_bytes()) for n in os.listdir(d)} == before


def test_output_is_an_independent_copy_unless_links_are_asked_for(tmp_path):
    """resave --output must not share inodes with DIR: a later in-place write to DIR (a streaming
    saver) would silently change OUT. --link asks for hard links."""
    d = tmp_path / "c"
    sd = _ckpt(d)
    out, linked = tmp_path / "out", tmp_path / "linked"
    for target, extra in ((out, []), (linked, ["--link"])):
        p = run_ckptctl("resave", str(d), "--output", str(target), *extra, "--json")
        assert p.returncode == 0, p.stderr
        assert same(load_dir(target), sd)
    shards = sorted(n for n in os.listdir(d) if n.startswith("model-"))
    assert shards and all(os.stat(out / n).st_ino != os.stat(d / n).st_ino for n in shards)
    assert all(os.stat(linked / n).st_ino == os.stat(d / n).st_ino for n in shards)
    with open(d / shards[0], "r+b") as f:  # an in-place write to the source
        f.seek(os.path.getsize(d / shards[0]) - 4)
        f.write(b"\xff\xff\xff\xff")
    assert same(load_dir(out), sd)
