"""``layout.scan``: what a path holds, from real files written by torch, safetensors,
huggingface_hub and torch DCP."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file

from ckptctl import layout as L
from ckptctl.errors import InputError
from ckptctl.findings import ERROR, INFO, WARNING


def sd(n: int = 4, width: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.weight": torch.randn(width, width, generator=g) for i in range(n)}


def codes(lay: L.Layout) -> list[str]:
    return sorted(f.code for f in lay.findings)


def touch(d: Path, *names: str, content: bytes = b"x") -> None:
    for n in names:
        (d / n).write_bytes(content)


def write_sharded_bin(d: Path, state: dict[str, torch.Tensor], n: int = 2) -> list[str]:
    names = sorted(state)
    files = [f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin" for i in range(n)]
    wm = {}
    for i, f in enumerate(files):
        part = {k: state[k] for k in names[i::n]}
        torch.save(part, d / f)
        wm.update({k: f for k in part})
    (d / L.PT_INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    return files


# ------------------------------------------------------------------------------------------
# One family each


def test_single_file_path(tmp_path: Path) -> None:
    save_file(sd(), tmp_path / "weights.safetensors")
    lay = L.scan(tmp_path / "weights.safetensors")
    assert lay.single_file == "weights.safetensors" and lay.root == tmp_path
    assert [(f.kind, f.files, f.index, f.container) for f in lay.families] == [
        (L.SAFETENSORS, ["weights.safetensors"], None, L.SAFETENSORS)]
    assert lay.findings == [] and L.choose(lay).files == ["weights.safetensors"]


def test_single_file_dir_with_extras(tmp_path: Path) -> None:
    save_file(sd(), tmp_path / "model.safetensors", metadata={"format": "pt"})
    touch(tmp_path, "config.json", "generation_config.json", "tokenizer.json", "README.md", "notes.txt")
    lay = L.scan(tmp_path)
    assert lay.single_file is None
    assert [(f.kind, f.files, f.index) for f in lay.families] == [(L.SAFETENSORS, ["model.safetensors"], None)]
    assert lay.extras == ["README.md", "config.json", "generation_config.json", "tokenizer.json"]
    assert lay.others == ["notes.txt"]
    assert lay.leftovers == [] and lay.findings == []
    assert lay.weight_files == {"model.safetensors"}


def test_sharded_safetensors(tmp_path: Path) -> None:
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    lay = L.scan(tmp_path)
    assert lay.findings == []
    fam = L.choose(lay)
    assert (fam.kind, fam.index, sorted(fam.files)) == (L.SAFETENSORS, L.ST_INDEX, shards)
    assert lay.weight_files == set(shards) | {L.ST_INDEX}
    # Pointing at the index file means the same as pointing at the directory.
    via_index = L.scan(tmp_path / L.ST_INDEX)
    assert [(f.kind, sorted(f.files), f.index) for f in via_index.families] == [(L.SAFETENSORS, shards, L.ST_INDEX)]


def test_pytorch_model_bin(tmp_path: Path) -> None:
    torch.save(sd(), tmp_path / "pytorch_model.bin")
    touch(tmp_path, "config.json")
    lay = L.scan(tmp_path)
    assert [(f.kind, f.files, f.container) for f in lay.families] == [(L.PYTORCH, ["pytorch_model.bin"], L.PYTORCH)]
    assert lay.extras == ["config.json"] and lay.findings == []


def test_sharded_bin_with_index(tmp_path: Path) -> None:
    files = write_sharded_bin(tmp_path, sd(5))
    lay = L.scan(tmp_path)
    assert lay.findings == []
    assert [(f.kind, sorted(f.files), f.index, f.container) for f in lay.families] == [
        (L.PYTORCH, files, L.PT_INDEX, L.PYTORCH)]


@pytest.mark.parametrize("name", ["training.pt", "ema.pth"])
def test_pt_file(tmp_path: Path, name: str) -> None:
    torch.save(sd(), tmp_path / name)
    for target in (tmp_path, tmp_path / name):
        lay = L.scan(target)
        assert [(f.kind, f.files, f.container) for f in lay.families] == [(L.PYTORCH, [name], L.PYTORCH)]
        assert lay.findings == []


def test_pt_beside_model_is_not_a_family(tmp_path: Path) -> None:
    save_file(sd(), tmp_path / "model.safetensors")
    torch.save({"step": torch.tensor(3)}, tmp_path / "optimizer.pt")
    lay = L.scan(tmp_path)
    assert [f.kind for f in lay.families] == [L.SAFETENSORS]
    assert lay.others == ["optimizer.pt"]


def adapter(d: Path, with_config: bool = True) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(2):
        base = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{base}.lora_A.weight"] = torch.randn(4, 16, generator=g)
        tensors[f"{base}.lora_B.weight"] = torch.zeros(16, 4)
    save_file(tensors, d / "adapter_model.safetensors", metadata={"format": "pt"})
    if with_config:
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
            "base_model_name_or_path": "tiny-llama", "task_type": "CAUSAL_LM"}))


def test_peft_adapter(tmp_path: Path) -> None:
    adapter(tmp_path)
    lay = L.scan(tmp_path)
    assert [(f.kind, f.files, f.container) for f in lay.families] == [
        (L.PEFT, ["adapter_model.safetensors"], L.SAFETENSORS)]
    assert lay.extras == ["adapter_config.json"] and lay.findings == []


def test_peft_adapter_without_config(tmp_path: Path) -> None:
    adapter(tmp_path, with_config=False)
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.adapter_without_config"]
    assert lay.findings[0].severity == ERROR


def test_peft_adapter_beside_model(tmp_path: Path) -> None:
    adapter(tmp_path)
    save_file(sd(), tmp_path / "model.safetensors")
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.adapter_beside_model"]
    assert lay.findings[0].severity == INFO
    with pytest.raises(InputError) as exc:
        L.choose(lay)
    assert "--only peft" in (exc.value.hint or "")  # the hint names a value --only accepts
    assert L.choose(lay, prefer="peft").files == ["adapter_model.safetensors"]
    assert L.choose(lay, prefer="safetensors").files == ["model.safetensors"]


def test_two_adapters(tmp_path: Path) -> None:
    adapter(tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "adapter_model.bin")
    assert "layout.two_adapters" in codes(L.scan(tmp_path))


def test_dcp_directory(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process, as intended
        dcp.save(sd(), checkpoint_id=str(ckpt))
    distcp = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert distcp and (ckpt / ".metadata").is_file()
    lay = L.scan(ckpt)
    assert [(f.kind, f.files, f.index, f.container) for f in lay.families] == [(L.DCP, distcp, ".metadata", L.DCP)]
    assert lay.findings == [] and lay.others == [] and lay.extras == []

    (ckpt / ".metadata").unlink()
    assert codes(L.scan(ckpt)) == ["layout.dcp_without_metadata"]


# ------------------------------------------------------------------------------------------
# Leftovers


LEFTOVERS = {
    "model-00001-of-?????.safetensors": "temp-shards",
    "pytorch_model-00002-of-?????.bin": "temp-shards",
    "_tmp_model.0123456789abcdef-0123abcd": "staging",  # ckptctl's own staging name, exactly
    ".tmpAbc123": "safetensors-tmp",
    "x.incomplete": "incomplete",
    "tmp-checkpoint-500": "trainer-tmp",
    "ckpt.orbax-checkpoint-tmp-1700000000": "orbax",
}


@pytest.mark.parametrize("name,preset", sorted(LEFTOVERS.items()))
def test_is_leftover(name: str, preset: str) -> None:
    assert L.is_leftover(name) == preset


@pytest.mark.parametrize("name", ["model.safetensors", "model-00001-of-00002.safetensors", "config.json",
                                  "tmp.txt", "my_tmp_file", "README.md", "pytorch_model.bin",
                                  # a user's folders: not provably anybody's leftover (names.LEFTOVERS)
                                  "_tmp_x", "_tmp_scratch", ".tmpl", "tmp-checkpoint-final"])
def test_not_leftover(name: str) -> None:
    assert L.is_leftover(name) is None


def test_leftovers_in_dir(tmp_path: Path) -> None:
    save_file(sd(), tmp_path / "model.safetensors")
    for name in LEFTOVERS:
        if name.startswith(("_tmp_", "tmp-checkpoint")) or ".orbax-checkpoint-tmp-" in name:
            (tmp_path / name).mkdir()
        else:
            save_file(sd(1), tmp_path / name)  # a temp shard is a real safetensors file
    lay = L.scan(tmp_path)
    assert sorted(lay.leftovers) == sorted(LEFTOVERS)
    assert [(f.kind, f.files) for f in lay.families] == [(L.SAFETENSORS, ["model.safetensors"])]
    assert codes(lay) == ["layout.leftover"] * len(LEFTOVERS)
    assert all(f.severity == WARNING for f in lay.findings)
    assert not (set(LEFTOVERS) & lay.weight_files)


# ------------------------------------------------------------------------------------------
# Ambiguities


def test_index_and_single_file(tmp_path: Path) -> None:
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    save_file(sd(6), tmp_path / "model.safetensors")
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.index_and_single"]
    assert sorted((f.index or "", len(f.files)) for f in lay.families)[0] == ("", 1)
    assert len(lay.families) == 2
    with pytest.raises(InputError):
        L.choose(lay)


def test_safetensors_and_bin(tmp_path: Path) -> None:
    """A pickle family with other tensors than the safetensors one is two models under one name."""
    save_file(sd(), tmp_path / "model.safetensors")
    torch.save(sd(3), tmp_path / "pytorch_model.bin")
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.two_families"]
    assert sorted(f.kind for f in lay.families) == [L.PYTORCH, L.SAFETENSORS]
    with pytest.raises(InputError) as exc:
        L.choose(lay)
    assert "--only" in (exc.value.hint or "")
    assert L.choose(lay, prefer="pytorch").files == ["pytorch_model.bin"]


def test_bin_with_the_same_tensors_as_safetensors_is_a_note(tmp_path: Path) -> None:
    """The conversion bot's layout: same names, dtypes and shapes (tied weights stored once in
    safetensors, as one view under two names in the pickle) is a note, and every command reads
    the safetensors family; naming the kind still reads the pickle."""
    tensors = sd()
    save_file(tensors, tmp_path / "model.safetensors")
    tied = dict(tensors, **{"lm_head.weight": tensors["model.layers.0.weight"]})
    torch.save(tied, tmp_path / "pytorch_model.bin")
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.converted_pickle"]
    assert L.choose(lay).files == ["model.safetensors"]
    assert L.choose(lay, prefer="pytorch").files == ["pytorch_model.bin"]
    tied["lm_head.weight"] = tensors["model.layers.0.weight"].clone()  # no longer one view: a tensor more
    torch.save(tied, tmp_path / "pytorch_model.bin")
    assert codes(L.scan(tmp_path)) == ["layout.two_families"]
    torch.save({k: v.half() for k, v in tensors.items()}, tmp_path / "pytorch_model.bin")  # another dtype
    assert codes(L.scan(tmp_path)) == ["layout.two_families"]


def test_unreferenced_shard(tmp_path: Path) -> None:
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    stale = "model-00009-of-00009.safetensors"
    save_file(sd(1), tmp_path / stale)
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.unreferenced_shard"]
    assert lay.findings[0].path == str(tmp_path / stale)
    assert stale not in L.choose(lay).files


def test_missing_index(tmp_path: Path) -> None:
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    (tmp_path / L.ST_INDEX).unlink()
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.missing_index"]
    assert lay.findings[0].severity == ERROR
    assert len(L.choose(lay).files) > 1 and L.choose(lay).index is None


def test_missing_bin_index(tmp_path: Path) -> None:
    write_sharded_bin(tmp_path, sd(4))
    (tmp_path / L.PT_INDEX).unlink()
    assert codes(L.scan(tmp_path)) == ["layout.missing_index"]


def test_shard_named_by_index_is_missing(tmp_path: Path) -> None:
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    (tmp_path / shards[-1]).unlink()
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.shard_missing"]
    assert shards[-1] in lay.findings[0].message
    assert sorted(L.choose(lay).files) == shards[:-1]


def test_index_naming_a_path_outside(tmp_path: Path) -> None:
    save_file(sd(1), tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / L.ST_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.layers.0.weight": "../model-00001-of-00001.safetensors"}}))
    lay = L.scan(tmp_path)
    assert "layout.shard_missing" in codes(lay)


def test_broken_index_is_reported(tmp_path: Path) -> None:
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    (tmp_path / L.ST_INDEX).write_text('{"weight_map": {"a": ')
    lay = L.scan(tmp_path)
    assert codes(lay) == ["index.bad_json"]
    assert sorted(L.choose(lay).files) == shards  # still lists the shards for inspection


def test_index_without_metadata_is_reported(tmp_path: Path) -> None:
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    doc = json.loads((tmp_path / L.ST_INDEX).read_text())
    del doc["metadata"]
    (tmp_path / L.ST_INDEX).write_text(json.dumps(doc))
    assert codes(L.scan(tmp_path)) == ["index.no_metadata"]


def test_stray_safetensors_file(tmp_path: Path) -> None:
    save_file(sd(), tmp_path / "model.safetensors")
    save_file(sd(1), tmp_path / "old-model.safetensors")
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.unrecognised_weights"]
    assert lay.findings[0].severity == ERROR

    alone = tmp_path / "alone"
    alone.mkdir()
    save_file(sd(1), alone / "consolidated.safetensors")
    lay = L.scan(alone)
    assert codes(lay) == ["layout.unrecognised_weights"] and lay.findings[0].severity == WARNING
    assert L.choose(lay).files == ["consolidated.safetensors"]


def test_empty_dir_and_bad_paths(tmp_path: Path) -> None:
    lay = L.scan(tmp_path)
    assert lay.families == [] and lay.findings == []
    with pytest.raises(InputError):
        L.choose(lay)
    with pytest.raises(InputError):
        L.scan(tmp_path / "absent")
    touch(tmp_path, "notes.txt")
    with pytest.raises(InputError):
        L.scan(tmp_path / "notes.txt")


def test_fifo_index_is_reported_and_never_opened(tmp_path):
    """A FIFO where the index should be would block a reader forever: layout never opens it."""
    import os

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    lay = L.scan(tmp_path)
    assert "layout.unsafe_index" in {f.code for f in lay.findings}
    assert sorted(lay.families[0].files) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


# ------------------------------------------------------------------------------------------
# Multi-component roots (their manifests, hand-written here; real library outputs are in the
# ecosystem tests)


def test_pipeline_root_components(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.42.1",
        "unet": ["diffusers", "UNet2DConditionModel"], "scheduler": ["diffusers", "DDPMScheduler"],
        "safety_checker": [None, None], "vae": ["diffusers", "AutoencoderKL"]}))
    (tmp_path / "unet").mkdir()
    save_file(sd(), tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    (tmp_path / "scheduler").mkdir()
    touch(tmp_path / "scheduler", "scheduler_config.json")
    lay = L.scan(tmp_path)
    assert lay.kind == L.PIPELINE and lay.families == []
    assert [(c.name, c.cls) for c in lay.components] == [
        ("scheduler", "DDPMScheduler"), ("unet", "UNet2DConditionModel"), ("vae", "AutoencoderKL")]
    unet = next(c for c in lay.components if c.name == "unet")
    assert [(f.stem, f.files) for f in unet.layout.families] == [
        ("diffusion_pytorch_model", ["diffusion_pytorch_model.safetensors"])]
    assert codes(lay) == ["layout.component_missing"] and "vae" in lay.findings[0].message
    assert "unet" not in lay.others and "scheduler" not in lay.others


def test_component_paths_are_never_followed_outside(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "../outside", "type": "x"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (root / "2_Dense").symlink_to(tmp_path / "outside")
    lay = L.scan(root)
    assert lay.kind == L.SENTENCE_TRANSFORMERS
    assert [c.layout for c in lay.components] == [None, None, None]
    assert codes(lay) == ["layout.component_missing"] * 2


def test_unreadable_component_manifest_is_a_finding(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text("[" * 100_000)
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.bad_component_manifest"] and lay.components == []


def test_native_weights_beside_hf_files_are_a_note_and_no_family(tmp_path: Path) -> None:
    """consolidated.safetensors with params.json beside an HF family (Mistral's repositories): kept
    out of every family; without params.json it is a stray as before."""
    save_torch_state_dict(sd(6), tmp_path, max_shard_size=2500)
    save_file(sd(2), tmp_path / "consolidated.safetensors")
    assert codes(L.scan(tmp_path)) == ["layout.unrecognised_weights"]
    (tmp_path / "params.json").write_text("{}")
    lay = L.scan(tmp_path)
    assert codes(lay) == ["layout.native_weights"] and lay.native == ["consolidated.safetensors"]
    assert "consolidated.safetensors" not in L.choose(lay).files


def test_trainer_state_files_are_not_a_model(tmp_path: Path) -> None:
    torch.save({"state": {}, "param_groups": []}, tmp_path / "optimizer.pt")
    torch.save({"last_epoch": 1}, tmp_path / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, tmp_path / "rng_state.pth")
    assert L.scan(tmp_path).families == []
    torch.save(sd(), tmp_path / "model.pt")  # a .pt model beside them still is one
    assert [f.files for f in L.scan(tmp_path).families] == [["model.pt"]]


def test_dcp_hf_shard_names_are_one_family(tmp_path: Path) -> None:
    for r in (1, 2):
        save_file(sd(2, seed=r), tmp_path / f"shard-0000{r}-model-00001-of-00001.safetensors")
    lay = L.scan(tmp_path)
    assert not lay.findings and [(f.kind, len(f.files)) for f in lay.families] == [(L.DCP_HF, 2)]
    root = tmp_path / "root"
    root.mkdir()
    (root / "sharded").mkdir()
    save_file(sd(2), root / "sharded" / "shard-00001-model-00001-of-00001.safetensors")
    lay = L.scan(root)
    shard = "sharded/shard-00001-model-00001-of-00001.safetensors"
    assert [(f.kind, f.files) for f in lay.families] == [(L.DCP_HF, [shard])]
