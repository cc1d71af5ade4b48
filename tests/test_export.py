"""export and the writer: stale files, tied tensors, sources, options, bad input (real files)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptctl import ExportOptions, export, save_state_dict
from ckptctl.errors import InputError, UsageError
from ckptctl.manifest import MANIFEST_NAME, sha256_file
from tests.support import (load_hub, run_ckptctl, same, staging_dirs, state, wait_stopped, write_sharded,
                           write_single)
from tests.support import load_glob as load_dir


# --- the four cases that broke mcore-bridge's saver ------------------------------------------

def test_single_file_over_two_shards_leaves_no_index(tmp_path):
    old, new = state(1), state(2)
    write_sharded(tmp_path / "old", old, per_shard=3)
    run_ckptctl("export", str(tmp_path / "old"), str(tmp_path / "out"), "--max-shard-size", "25KB", check=True)
    assert len(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]) == 6
    assert len(list((tmp_path / "out").glob("model-0000?-of-00002.safetensors"))) == 2
    write_single(tmp_path / "new", new)
    run_ckptctl("export", str(tmp_path / "new"), str(tmp_path / "out"), "--overwrite", check=True)
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == ["model.safetensors"]
    assert same(load_dir(tmp_path / "out"), new)
    assert same(load_hub(tmp_path / "out"), new)
    assert staging_dirs(tmp_path) == []


def test_two_shards_over_four_removes_surplus(tmp_path):
    four, two = state(1, n=8), state(2, n=8)
    write_sharded(tmp_path / "a", four, per_shard=2)
    write_sharded(tmp_path / "b", two, per_shard=4)
    run_ckptctl("export", str(tmp_path / "a"), str(tmp_path / "out"), "--max-shard-size", "20KB", check=True)
    assert len(list((tmp_path / "out").glob("model-*-of-00004.safetensors"))) == 4
    run_ckptctl("export", str(tmp_path / "b"), str(tmp_path / "out"), "--overwrite", "--max-shard-size", "40KB",
                check=True)
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    assert same(load_dir(tmp_path / "out"), two)
    assert same(load_hub(tmp_path / "out"), two)


def test_same_export_twice_is_byte_identical(tmp_path):
    write_sharded(tmp_path / "src", state(3), per_shard=2)
    run_ckptctl("export", str(tmp_path / "src"), str(tmp_path / "a"), "--max-shard-size", "20KB", check=True)
    first = {n: sha256_file(tmp_path / "a" / n) for n in os.listdir(tmp_path / "a")}
    run_ckptctl("export", str(tmp_path / "src"), str(tmp_path / "a"), "--max-shard-size", "20KB", "--overwrite",
                check=True)
    second = {n: sha256_file(tmp_path / "a" / n) for n in os.listdir(tmp_path / "a")}
    assert first == second


def test_adapter_export_beside_model_keeps_model_files(tmp_path):
    model = state(4)
    write_single(tmp_path / "out", model)
    (tmp_path / "out" / "config.json").write_text('{"model_type": "llama"}')
    ad = tmp_path / "adapter"
    ad.mkdir()
    lora = {"base_model.model.layer.0.lora_A.weight": torch.randn(4, 32),
            "base_model.model.layer.0.lora_B.weight": torch.zeros(64, 4)}
    torch.save(lora, ad / "adapter_model.bin")
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["layer.0"]}))
    before = {n: sha256_file(tmp_path / "out" / n) for n in os.listdir(tmp_path / "out")}
    run_ckptctl("export", str(ad), str(tmp_path / "out"), "--overwrite", check=True)
    names = set(os.listdir(tmp_path / "out"))
    assert names == set(before) | {"adapter_model.safetensors", "adapter_config.json"}
    for n, digest in before.items():
        assert sha256_file(tmp_path / "out" / n) == digest
    got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert same(got, lora)
    # and the reverse: re-exporting the full model keeps the adapter
    write_single(tmp_path / "m2", state(5))
    run_ckptctl("export", str(tmp_path / "m2"), str(tmp_path / "out"), "--overwrite", check=True)
    assert same(load_file(str(tmp_path / "out" / "adapter_model.safetensors")), lora)
    assert same(load_file(str(tmp_path / "out" / "model.safetensors")), state(5))


# --- stale files and carry-over ----------------------------------------------------------------

def test_overwrite_drops_every_old_weight_family_and_keeps_the_rest(tmp_path):
    out = tmp_path / "out"
    write_sharded(out, state(1), per_shard=2)
    torch.save(state(9), out / "pytorch_model.bin")
    (out / "model-00001-of-?????.safetensors").write_bytes(b"junk")
    (out / "consolidated.safetensors").write_bytes((tmp_path / "x").write_bytes(b"") or b"")
    (out / "README.md").write_text("my notes")
    (out / "optimizer").mkdir()
    (out / "optimizer" / "state.pt").write_bytes(b"opt")
    readme_inode = os.stat(out / "README.md").st_ino
    write_single(tmp_path / "new", state(2))
    run_ckptctl("export", str(tmp_path / "new"), str(out), "--overwrite", check=True)
    # a *.safetensors outside the naming scheme is not provably a superseded family: carried (issue 15)
    assert sorted(os.listdir(out)) == ["README.md", "consolidated.safetensors", "model.safetensors", "optimizer"]
    assert (out / "consolidated.safetensors").read_bytes() == b""
    assert (out / "README.md").read_text() == "my notes"
    assert os.stat(out / "README.md").st_ino == readme_inode  # hard link, not a copy
    assert (out / "optimizer" / "state.pt").read_bytes() == b"opt"


def test_extras_are_copied_from_source(tmp_path):
    src = tmp_path / "src"
    write_single(src, state(1))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    (src / "tokenizer.json").write_text("{}")
    (src / "generation_config.json").write_text("{}")
    (src / "notes.txt").write_text("not copied")
    run_ckptctl("export", str(src), str(tmp_path / "out"), "--dtype", "bf16", check=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json"]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


# --- tensors -----------------------------------------------------------------------------------

def test_tied_and_noncontiguous_tensors(tmp_path):
    emb = torch.randn(16, 8)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "t": torch.randn(8, 16).t(),
          "slice": torch.randn(10, 10)[2:5], "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3)}
    res = save_state_dict(sd, tmp_path / "out")
    assert res.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(sd) - {"lm_head.weight"}
    for k, v in got.items():
        assert torch.equal(v, sd[k].contiguous())
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata()["lm_head.weight"] == "model.embed_tokens.weight"
        assert f.metadata()["format"] == "pt"


def test_grouping_matches_huggingface_hub(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    g = torch.Generator().manual_seed(0)
    sizes = [int(x) for x in torch.randint(1, 40, (60,), generator=g)]
    sd = {f"t{i:03d}": torch.zeros(s, dtype=torch.uint8) for i, s in enumerate(sizes)}
    for limit in (10, 39, 50, 100, 1000):
        res = save_state_dict(sd, tmp_path / f"o{limit}", max_shard_size=limit)
        hub = split_torch_state_dict_into_shards(sd, max_shard_size=limit)
        assert hub.is_sharded  # 1,289 bytes in all
        idx = json.loads((tmp_path / f"o{limit}" / "model.safetensors.index.json").read_text())
        assert idx["weight_map"] == dict(sorted(hub.tensor_to_filename.items()))
        assert idx["metadata"]["total_size"] == hub.metadata["total_size"]
        assert list(idx["weight_map"]) == sorted(idx["weight_map"])
        assert res.index == "model.safetensors.index.json"
        assert sorted(os.listdir(tmp_path / f"o{limit}")) == sorted(hub.filename_to_tensors) + [res.index]
        for name, names in hub.filename_to_tensors.items():  # each shard holds exactly its tensors
            with safe_open(str(tmp_path / f"o{limit}" / name), "pt") as f:
                assert sorted(f.keys()) == sorted(names)


def test_oversize_tensor_alone_in_its_shard(tmp_path):
    sd = {"a": torch.zeros(6, dtype=torch.uint8), "b": torch.zeros(15, dtype=torch.uint8),
          "c": torch.zeros(3, dtype=torch.uint8), "d": torch.zeros(4, dtype=torch.uint8)}
    save_state_dict(sd, tmp_path / "o", max_shard_size=10)
    wm = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())["weight_map"]
    assert wm == {"b": "model-00001-of-00003.safetensors", "a": "model-00002-of-00003.safetensors",
                  "c": "model-00002-of-00003.safetensors", "d": "model-00003-of-00003.safetensors"}


def test_kernel_copy_for_same_dtype_and_streaming_for_conversion(tmp_path):
    write_single(tmp_path / "src", state(1))
    r = export(tmp_path / "src", tmp_path / "a", ExportOptions(fsync=False))
    total = sum(t.numel() * 4 for t in state(1).values())
    assert r.bytes_copied_by_kernel == total and r.bytes_streamed == 0
    r = export(tmp_path / "src", tmp_path / "b", ExportOptions(dtype="fp16", fsync=False))
    assert r.bytes_copied_by_kernel == 0 and r.bytes_streamed == total // 2
    got = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert same(got, {k: v.half() for k, v in state(1).items()})


def test_bounded_chunks_give_identical_bytes(tmp_path):
    sd = state(7, n=3, rows=300, cols=100)
    write_single(tmp_path / "src", sd)
    export(tmp_path / "src", tmp_path / "a", ExportOptions(fsync=False, chunk_bytes=4096, dtype="bf16"))
    export(tmp_path / "src", tmp_path / "b", ExportOptions(fsync=False, dtype="bf16"))
    assert sha256_file(tmp_path / "a" / "model.safetensors") == sha256_file(tmp_path / "b" / "model.safetensors")


# --- sources -----------------------------------------------------------------------------------

def test_bin_sources_single_sharded_and_nested_key(tmp_path):
    sd = state(11)
    (tmp_path / "single").mkdir()
    torch.save(sd, tmp_path / "single" / "pytorch_model.bin")
    run_ckptctl("export", str(tmp_path / "single"), str(tmp_path / "o1"), check=True)
    assert same(load_dir(tmp_path / "o1"), sd)

    sh = tmp_path / "sharded"
    sh.mkdir()
    names = list(sd)
    wm = {}
    for i, part in enumerate((names[:3], names[3:]), start=1):
        fname = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({k: sd[k] for k in part}, sh / fname)
        wm.update({k: fname for k in part})
    (sh / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    run_ckptctl("export", str(sh), str(tmp_path / "o2"), check=True)
    assert same(load_dir(tmp_path / "o2"), sd)

    torch.save({"state_dict": sd, "step": 7, "optimizer": {"lr": 0.1}}, tmp_path / "train.pt")
    p = run_ckptctl("export", str(tmp_path / "train.pt"), str(tmp_path / "o3"))
    assert p.returncode == 2 and "--key" in p.stderr
    run_ckptctl("export", str(tmp_path / "train.pt"), str(tmp_path / "o3"), "--key", "state_dict", check=True)
    assert same(load_dir(tmp_path / "o3"), sd)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil"
    src.mkdir()
    torch.save({"w": torch.zeros(2), "x": _Evil(str(marker))}, src / "pytorch_model.bin")
    p = run_ckptctl("export", str(src), str(tmp_path / "out"))
    assert p.returncode == 2, p.stderr
    assert "refused to unpickle" in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and staging_dirs(tmp_path) == []


def test_repo_id_from_local_hf_cache(tmp_path):
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    write_single(snap, state(12))
    (cache / "models--org--tiny" / "refs").mkdir(parents=True)
    (cache / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    p = run_ckptctl("export", "org/tiny", str(tmp_path / "out"),
                    env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, check=True)
    assert p.returncode == 0
    assert same(load_dir(tmp_path / "out"), state(12))


def test_hf_cache_repo_folder_exports_the_snapshot_refs_main_names(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    write_single(repo / "snapshots" / ("a" * 40), state(12))
    write_single(repo / "snapshots" / ("b" * 40), state(13))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    p = run_ckptctl("export", repo, tmp_path / "out", check=True)
    assert f"snapshot {'b' * 40} (refs/main)" in p.stderr
    assert same(load_dir(tmp_path / "out"), state(13))
    (repo / "refs" / "main").unlink()  # two snapshots, no ref: never a guess
    p = run_ckptctl("export", repo, tmp_path / "out2")
    assert p.returncode == 2 and "a" * 40 in p.stderr and "b" * 40 in p.stderr, p.stderr
    assert not (tmp_path / "out2").exists()
    shutil.rmtree(repo / "snapshots" / ("a" * 40))  # the only snapshot
    p = run_ckptctl("export", repo, tmp_path / "out3", check=True)
    assert f"snapshot {'b' * 40} (the only one)" in p.stderr
    assert same(load_dir(tmp_path / "out3"), state(13))


# --- options and bad input ---------------------------------------------------------------------

def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    write_sharded(tmp_path / "src", state(1), per_shard=2)
    (tmp_path / "src" / "config.json").write_text("{}")
    run_ckptctl("export", str(tmp_path / "src"), str(tmp_path / "out"), "--manifest", "--label", "step-7",
                "--max-shard-size", "20KB", check=True)
    doc = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert doc["label"] == "step-7"
    files = set(os.listdir(tmp_path / "out")) - {MANIFEST_NAME}
    assert set(doc["files"]) == files
    for name, entry in doc["files"].items():
        assert entry["size"] == (tmp_path / "out" / name).stat().st_size
        assert entry["sha256"] == sha256_file(tmp_path / "out" / name)


def test_dry_run_changes_nothing_and_reports_plan(tmp_path):
    write_single(tmp_path / "src", state(1))
    write_sharded(tmp_path / "out", state(2), per_shard=2)
    before = sorted(os.listdir(tmp_path / "out"))
    p = run_ckptctl("export", str(tmp_path / "src"), str(tmp_path / "out"), "--overwrite", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["dry_run"] and doc["ok"] and doc["files"][0]["name"] == "model.safetensors"
    assert "model.safetensors.index.json" in doc["removed"]
    assert sorted(os.listdir(tmp_path / "out")) == before and staging_dirs(tmp_path) == []


@pytest.mark.parametrize("case", ["exists", "inside", "not_ckpt", "corrupt", "bad_size", "empty"])
def test_bad_input_one_line_error_and_nothing_left(tmp_path, case):
    src = tmp_path / "src"
    write_single(src, state(1))
    dst = tmp_path / "out"
    args = [str(src), str(dst)]
    if case == "exists":
        dst.mkdir()
        (dst / "keep").write_text("x")
    elif case == "inside":
        args = [str(src), str(src / "sub")]
    elif case == "not_ckpt":
        (tmp_path / "nothing").mkdir()
        args = [str(tmp_path / "nothing"), str(dst)]
    elif case == "corrupt":
        raw = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(raw[:-10])
    elif case == "bad_size":
        args += ["--max-shard-size", "5XB"]
    elif case == "empty":
        save_state_dict({"a": torch.zeros(1)}, tmp_path / "e")  # sanity: a valid one works
        (tmp_path / "e2").mkdir()
        from safetensors.torch import save_file
        save_file({}, str(tmp_path / "e2" / "model.safetensors"))
        args = [str(tmp_path / "e2"), str(dst)]
    p = run_ckptctl("export", *args)
    assert p.returncode == 2, (case, p.returncode, p.stderr)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert lines[0].startswith("error: ") and any(l.startswith("hint: ") for l in lines), p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    if case == "exists":
        assert os.listdir(dst) == ["keep"]
    elif case != "inside":
        assert not dst.exists()
    assert staging_dirs(tmp_path) == []


def test_library_errors_are_typed(tmp_path):
    with pytest.raises(UsageError):
        save_state_dict({"a": torch.zeros(1)}, tmp_path / "x", dtype="fp8")
    with pytest.raises(InputError):
        save_state_dict({"a": torch.zeros(1, device="meta")}, tmp_path / "x")
    with pytest.raises(InputError):
        save_state_dict({}, tmp_path / "x")


def test_fifo_where_a_shard_should_be_is_refused_without_hanging(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "model.safetensors")
    p = run_ckptctl("export", str(src), str(tmp_path / "out"), timeout=60)
    assert p.returncode == 2 and "not a regular file" in p.stderr and not (tmp_path / "out").exists()
    p = run_ckptctl("inspect", str(src), timeout=60)
    assert p.returncode == 2 and "header.not_a_file" in p.stderr


def test_destination_created_during_the_write_is_never_replaced(tmp_path):
    """Without --overwrite a destination that appears while we write is left alone (exit 3)."""
    import signal
    import subprocess
    import sys

    write_single(tmp_path / "src", state(1))
    dst = tmp_path / "out"
    env = dict(os.environ, CKPTCTL_STOP_AT="sealed")
    proc = subprocess.Popen([sys.executable, "-m", "ckptctl", "export", str(tmp_path / "src"), str(dst)],
                            stderr=subprocess.PIPE, env=env)
    wait_stopped(proc.pid)
    dst.mkdir()
    (dst / "precious.txt").write_text("mine")
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and b"appeared while we were writing" in err
    assert os.listdir(dst) == ["precious.txt"] and staging_dirs(tmp_path) == []


def test_overwrite_replaces_the_main_family_and_keeps_a_variant_it_does_not_own(tmp_path):
    out = tmp_path / "out"
    write_single(out, state(1))
    torch.save(state(1), out / "pytorch_model.bin")  # the main slot's pickle: replaced too
    torch.save(state(2), out / "pytorch_model.fp16.bin")  # from_pretrained(variant="fp16") reads it
    variant_bytes = (out / "pytorch_model.fp16.bin").read_bytes()
    (out / "training_args.bin").write_bytes(b"args")
    write_single(tmp_path / "src", state(3))
    run_ckptctl("export", str(tmp_path / "src"), str(out), "--overwrite", check=True)
    assert sorted(os.listdir(out)) == ["model.safetensors", "pytorch_model.fp16.bin", "training_args.bin"]
    assert (out / "pytorch_model.fp16.bin").read_bytes() == variant_bytes


def test_bad_choice_with_json_still_prints_one_document(tmp_path):
    write_single(tmp_path / "src", state(1))
    p = run_ckptctl("export", str(tmp_path / "src"), str(tmp_path / "o"), "--dtype", "fp8", "--json")
    assert p.returncode == 2 and json.loads(p.stdout)["ok"] is False and "fp8" in p.stderr
