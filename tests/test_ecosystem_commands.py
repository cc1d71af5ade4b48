"""Every command on every layout of the corpus (issue 12): ``inspect`` counts what the library holds,
``export`` and ``resave --max-shard-size`` give a directory the library's own loader reloads
bit-exactly (same output), ``resave --repair`` of a sound checkpoint writes nothing, and what is not
one model (a training state, a multi-component root) is refused with the next step.

In-process library calls throughout (the corpus builds are shared, session-scoped); one subprocess
per command kind where the exit code and the messages are the point."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ecosystem import ENTRIES, Entry, by_name, compare, dirname, fresh_copy
from ckptctl.api import export
from ckptctl.errors import UsageError
from ckptctl.inspect import inspect_path
from ckptctl.resave import resave
from ckptctl.write.options import ExportOptions
from ckptctl.write.tree import RootResult
from tests.support import run_ckptctl

pytest_plugins = ["ecosystem.fixtures"]

NAMES = [e.name for e in ENTRIES]
ROOTS = {"pipeline", "pipeline-variant", "st-root"}  # multi-component roots
ADAPTERS = {"adapter"}
DCP = {"dcp", "dcp-nested"}
# inspect counts the elements of the tensors stored in the files (each stored tensor once, so a
# tied weight stored once counts once). The library's count differs where it stores buffers it does
# not count as parameters, or recomputes parameters it does not store:
STORED_NOT_PARAMETERS = {
    "transformers/deepseek_v3": 4,  # the router's e_score_correction_bias buffer (4 experts)
    "transformers/bart": 96,  # final_logits_bias buffer (vocab 96)
    "transformers/pegasus": 96,  # final_logits_bias buffer
    # final_logits_bias (+96); the sinusoidal position tables (2 x 64 x 32 = 4096) are not stored
    "transformers/marian": 96 - 4096,
}

# Loaders that read one file by name and no index: a resharded checkpoint is not theirs to read.
ONE_FILE_LOADERS = {
    "accelerate/save-state": "accelerate's load_state reads model.safetensors only (no index)",
    "safetensors/save-file": "the entry's loader is safetensors.load_file('model.safetensors')",
    "safetensors/save-model": "the entry's loader is safetensors.torch.load_model('model.safetensors')",
}


def _source(name: str, d: Path) -> Path:
    """The checkpoint directory a command is pointed at."""
    if name == "transformers/trainer":
        return d / "checkpoint-2"  # the Trainer's output_dir holds checkpoint-N/ folders
    if name == "transformers/hf-cache":
        return next((d / "models--ckptctl-test--tiny-llama" / "snapshots").iterdir())
    return d


def _key(name: str) -> str | None:
    return "model" if by_name(name).layout == "dcp-nested" else None


def _tree(d: Path) -> dict[str, tuple[int, bytes]]:
    """Every file below ``d``: (inode, bytes)."""
    out = {}
    for base, _, files in os.walk(d):
        for f in files:
            p = Path(base) / f
            out[str(p.relative_to(d))] = (os.lstat(p).st_ino, p.read_bytes() if not p.is_symlink() else b"")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_what_the_library_holds(name: str, build_one) -> None:
    d = build_one(name)
    e = by_name(name)
    res = inspect_path(_source(name, d), key=_key(name))
    assert res.parameters == e.parameters + STORED_NOT_PARAMETERS.get(name, 0)
    if e.layout in ROOTS:
        assert [c.path for c in res.components if c.tensors] and sum(c.parameters for c in res.components) == \
            res.parameters


def _reloader(name: str) -> Entry:
    """The entry whose loader reads an export of ``name``: the HF cache entry's loader reads a
    hub cache, its snapshot is a plain transformers Llama checkpoint."""
    return by_name("transformers/llama" if name == "transformers/hf-cache" else name)


@pytest.mark.parametrize("name", NAMES)
def test_export_reloads_bit_exactly_with_the_library(name: str, build_one, tmp_path: Path) -> None:
    d = build_one(name)
    e = by_name(name)
    out = tmp_path / "out"
    dest = out / "checkpoint-2" if name == "transformers/trainer" else out
    res = export(_source(name, d), dest, ExportOptions(fsync=False), key=_key(name))
    assert isinstance(res, RootResult) == (e.layout in ROOTS)
    if e.layout in DCP or e.layout == "accelerate-state":
        # the output is the model alone, in safetensors: DCP's loader does not read that, and
        # accelerate's load_state wants the optimizer state export leaves out. Compare its
        # tensors with the model state the library saved.
        from safetensors.torch import load_file

        want = {k.split("/", 1)[1] if "/" in k else k: v for k, v in e.load(d).items()
                if e.layout == "dcp" or k.startswith("model/")}
        assert compare(want, load_file(str(dest / "model.safetensors"))) == []
        assert os.listdir(dest) == ["model.safetensors"] or e.layout == "accelerate-state"
        return
    r = _reloader(name)
    assert compare(e.load(d), r.load(out)) == []
    if e.forward is not None:
        import torch

        assert torch.equal(e.forward(d), r.forward(out))
    if e.layout in ROOTS:  # the whole root, each component under its own library's names
        assert _slots(out) == _slots(d) and _others(out) == _others(d)
    if e.layout == "variant-beside-main":  # the variant is carried as it is
        assert {n: (d / n).read_bytes() for n in os.listdir(d) if ".fp16" in n} == \
            {n: (out / n).read_bytes() for n in os.listdir(out) if ".fp16" in n}
    if name == "transformers/trainer":  # the model only, never the training state
        assert not {"optimizer.pt", "scheduler.pt", "rng_state.pth"} & set(os.listdir(dest))


def _resave(name: str, path: Path, opts: ExportOptions, **kw):
    """resave, which hands a multi-component root to its whole-root twin (``resave.root.resave_root``)."""
    result = resave(path, opts, **kw)
    assert isinstance(result, RootResult) == (by_name(name).layout in ROOTS)
    return result


def _slots(d: Path) -> set[tuple[str, tuple[str, str | None]]]:
    """(folder, slot) of every weights file below ``d``: each component's library names and variants."""
    from ckptctl.layout import named_slot

    return {(os.path.relpath(b, d), slot) for b, _, files in os.walk(d) for f in files
            if (slot := named_slot(f)) is not None}


def _others(d: Path) -> dict[str, bytes]:
    """Every other file below ``d`` (configs, manifests, scheduler, tokenizer): path -> bytes."""
    from ckptctl.layout import named_slot

    return {str((Path(b) / f).relative_to(d)): (Path(b) / f).read_bytes() for b, _, files in os.walk(d)
            for f in files if named_slot(f) is None}


@pytest.mark.parametrize("name", NAMES)
def test_resave_max_shard_size_reloads_bit_exactly(name: str, build_one, tmp_path: Path) -> None:
    e = by_name(name)
    if e.layout in ADAPTERS | DCP or name == "transformers/hf-cache":
        pytest.skip("resave refuses adapters and DCP (test_resave_refusals_name_the_command); the HF cache "
                    "entry's snapshot is links into blobs/ shared by other snapshots")
    if name in ONE_FILE_LOADERS:
        pytest.skip(ONE_FILE_LOADERS[name])
    d = build_one(name)
    c = fresh_copy(d, tmp_path / "c")
    res = _resave(name, _source(name, c), ExportOptions(max_shard_size="20KB", fsync=False))
    assert compare(e.load(d), e.load(c)) == []
    if e.layout in ROOTS:  # one publish of the whole root; every other file kept as it was
        import torch

        assert res.publish == "exchange" and not res.unchanged and torch.equal(e.forward(d), e.forward(c))
        assert _slots(c) == _slots(d) and _others(c) == _others(d)


@pytest.mark.parametrize("name", NAMES)
def test_repair_of_a_sound_checkpoint_writes_nothing(name: str, build_one, tmp_path: Path) -> None:
    e = by_name(name)
    if e.layout in ADAPTERS | DCP:
        pytest.skip("resave refuses adapters and DCP (test_resave_refusals_name_the_command)")
    d = build_one(name)
    c = fresh_copy(d, tmp_path / "c")
    before = _tree(c)
    res = _resave(name, _source(name, c), ExportOptions(fsync=False, max_shard_size=None), repair=True)
    assert res.unchanged
    assert (res if e.layout in ROOTS else res.export).publish is None
    assert _tree(c) == before  # same files, same bytes, same inodes


def test_repair_cli_says_nothing_to_repair(build_one, tmp_path: Path) -> None:
    c = fresh_copy(build_one("diffusers/unet-fp16-beside-main-sharded"), tmp_path / "c")
    before = _tree(c)
    proc = run_ckptctl("resave", "--repair", c)
    assert proc.returncode == 0 and "nothing to repair" in proc.stdout, proc.stderr
    assert _tree(c) == before


@pytest.mark.parametrize("name,kind,components", [
    ("diffusers/pipeline", "diffusers-pipeline", {"text_encoder", "unet", "vae"}),
    ("sentence-transformers/root", "sentence-transformers", {".", "2_Dense"}),
])
def test_export_cli_writes_a_root_whole(name: str, kind: str, components: set[str], build_one,
                                        tmp_path: Path) -> None:
    d = build_one(name)
    proc = run_ckptctl("export", d, tmp_path / "out", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["kind"] == kind
    assert set(doc["components"]) == components and doc["publish"] == "rename"
    assert doc["parameters"] == by_name(name).parameters
    assert os.listdir(tmp_path) == ["out"]  # one publish, no staging left
    assert _slots(tmp_path / "out") == _slots(d) and _others(tmp_path / "out") == _others(d)


def test_export_of_a_root_over_a_root_keeps_what_it_does_not_own(build_one, tmp_path: Path) -> None:
    """Each component's other variant and the user's files stay; the old main family, an old
    manifest and a leftover go; the pipeline reloads (main and fp16) bit-exactly."""
    out = fresh_copy(build_one("diffusers/pipeline-fp16-beside-main"), tmp_path / "out")
    fp16 = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*.fp16.safetensors")}
    assert len(fp16) == 3
    (out / "README.md").write_text("keep me")
    (out / "ckptctl.manifest.json").write_text("{}")
    (out / "tmp-checkpoint-1").mkdir()
    src = build_one("diffusers/pipeline-sharded")
    res = export(src, out, ExportOptions(fsync=False, overwrite=True))
    assert res.publish == "exchange" and res.kept == ["README.md"]
    assert sorted(res.removed) == ["ckptctl.manifest.json", "tmp-checkpoint-1"]
    assert (out / "README.md").read_text() == "keep me"
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*.fp16.safetensors")} == fp16
    e = by_name("diffusers/pipeline-fp16-beside-main")
    assert compare(e.load(build_one("diffusers/pipeline-fp16-beside-main")), e.load(out)) == []
    assert not list(out.rglob("*-of-*")) and not list(out.rglob("*.index.json"))  # the new main family: single files
    assert os.listdir(tmp_path) == ["out"]


def test_reexport_replaces_a_variant_family_whole(build_one, tmp_path: Path) -> None:
    """The source's fp16 variant is one file; the old destination's was three shards + an index:
    the new version holds the source's variant only (never an index beside shards it dropped)."""
    from safetensors.torch import load_file, save_file

    src = fresh_copy(build_one("transformers/llama-fp16-beside-main-sharded"), tmp_path / "src")
    shards = sorted(src.glob("model.fp16-*.safetensors"))
    merged = {k: v for s in shards for k, v in load_file(str(s)).items()}
    for s in shards:
        s.unlink()
    (src / "model.safetensors.index.fp16.json").unlink()
    save_file(merged, str(src / "model.fp16.safetensors"), metadata={"format": "pt"})
    out = fresh_copy(build_one("transformers/llama-fp16-beside-main-sharded"), tmp_path / "out")
    res = export(src, out, ExportOptions(fsync=False, overwrite=True))
    assert res.variants == ["model.fp16.safetensors"]
    assert {"model.fp16-00001-of-00003.safetensors", "model.safetensors.index.fp16.json"} <= set(res.removed)
    assert sorted(n for n in os.listdir(out) if "fp16" in n) == ["model.fp16.safetensors"]
    e = by_name("transformers/llama-fp16-beside-main-sharded")
    assert compare(e.load(build_one("transformers/llama-fp16-beside-main-sharded")), e.load(out)) == []


def test_inspect_of_an_hf_cache_repo_folder(build_one, tmp_path: Path) -> None:
    from ecosystem.transformers_layouts import COMMIT, OLD_COMMIT, REPO_FOLDER

    folder = build_one("transformers/hf-cache") / REPO_FOLDER
    proc = run_ckptctl("inspect", folder, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["path"] == str(folder / "snapshots" / COMMIT)
    assert doc["parameters"] == by_name("transformers/hf-cache").parameters
    assert f"snapshot {COMMIT} (refs/main)" in proc.stderr
    # without refs/main, two snapshots are never chosen between: the user is asked for one
    c = fresh_copy(folder.parent, tmp_path / "cache") / REPO_FOLDER
    (c / "refs" / "main").unlink()
    proc = run_ckptctl("inspect", c)
    assert proc.returncode == 2 and OLD_COMMIT in proc.stderr and COMMIT in proc.stderr, proc.stderr
    assert "snapshots/<commit>" in proc.stderr


@pytest.mark.parametrize("name", ["dcp/train-state", "dcp/fsdp2-train-state"])
def test_a_training_state_is_refused_without_key(name: str, build_one, tmp_path: Path) -> None:
    """export needs --key; inspect shows the top-level keys instead (issue 30)."""
    d = build_one(name)
    proc = run_ckptctl("export", d, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert "top-level keys: model, optimizer, step" in proc.stderr and "--key" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_ckptctl("inspect", d)
    assert proc.returncode == 0 and all(k in proc.stdout for k in ("model", "optimizer", "step")), proc.stderr
    proc = run_ckptctl("inspect", "--key", "model", "--json", d)
    assert proc.returncode == 0 and f'"parameters": {by_name(name).parameters}' in proc.stdout


@pytest.mark.parametrize("name,hint", [("peft/lora", "ckptctl export"), ("dcp/single", "ckptctl export")])
def test_resave_refusals_name_the_command(name: str, hint: str, build_one, tmp_path: Path) -> None:
    c = fresh_copy(build_one(name), tmp_path / "c")
    before = _tree(c)
    with pytest.raises(UsageError) as info:
        resave(c, ExportOptions(fsync=False, max_shard_size=None), repair=True)
    assert hint in (info.value.hint or "")
    assert _tree(c) == before


@pytest.mark.parametrize("name,files", [
    ("diffusers/unet-sharded", {"diffusion_pytorch_model.safetensors.index.json"}),
    ("transformers/llama-fp16-sharded", {"model.safetensors.index.fp16.json"}),
    ("diffusers/unet-fp16", {"diffusion_pytorch_model.fp16.safetensors"}),
])
def test_export_keeps_the_library_names_and_variant(name: str, files: set[str], build_one, tmp_path: Path) -> None:
    export(build_one(name), tmp_path / "out", ExportOptions(fsync=False, max_shard_size="20KB"
                                                           if "sharded" in name else None))
    names = set(os.listdir(tmp_path / "out"))
    assert files <= names and not {n for n in names if n.startswith("model.safetensors")} - files
    stem = "diffusion_pytorch_model" if name.startswith("diffusers") else "model"
    assert all(n.startswith(stem) or n.endswith(".json") for n in names)


def test_export_over_a_variant_keeps_the_other_family(build_one, tmp_path: Path) -> None:
    d = build_one("transformers/llama-fp16-beside-main-sharded")
    out = fresh_copy(d, tmp_path / "out")
    fp16 = {n: (out / n).read_bytes() for n in os.listdir(out) if ".fp16" in n}
    export(build_one("transformers/llama"), out, ExportOptions(fsync=False, overwrite=True))
    names = set(os.listdir(out))
    assert {n: (out / n).read_bytes() for n in names if ".fp16" in n} == fp16
    assert "model.safetensors" in names and not any(n.startswith("model-0") for n in names)
    assert "model.safetensors.index.json" not in names
    assert compare(by_name("transformers/llama").load(build_one("transformers/llama")),
                   {k.split("/", 1)[1]: v for k, v in by_name("transformers/llama-fp16-beside-main-sharded")
                    .load(out).items() if k.startswith("main/")}) == []
