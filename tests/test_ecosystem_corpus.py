"""The corpus's own sanity tests: every entry, built by its real library, reloads with that library's
loader bit-exactly against the in-memory object that wrote it (names, dtypes, shapes, bytes), runs
to the same output, counts the parameters it claims, and has the files of the layout it claims."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from ecosystem import ENTRIES, LIBRARIES, build, by_name, compare, dirname, fresh_copy, missing_libraries, reference
from ecosystem.transformers_models import MODELS

pytest_plugins = ["ecosystem.fixtures"]

NAMES = [e.name for e in ENTRIES]
SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.")


def _require(name: str) -> None:
    missing = missing_libraries(name)
    if missing:
        pytest.skip(f"{name} needs {', '.join(missing)}, not installed")


def _tree(d: Path) -> dict[str, tuple[str, str]]:
    """Every path under d -> (kind, content digest or link target): what a loader must not change."""
    out: dict[str, tuple[str, str]] = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            p = Path(root) / n
            rel = str(p.relative_to(d))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", "")
            else:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# -- layouts --------------------------------------------------------------------------------------

STEM = {"diffusers": "diffusion_pytorch_model", "peft": "adapter_model"}


def _families(d: Path) -> dict[str, list[str]]:
    """Weights files of a directory grouped by family: (stem, variant, container) -> names."""
    out: dict[str, list[str]] = {}
    for p in d.iterdir():
        m = re.fullmatch(r"(model|diffusion_pytorch_model|adapter_model|pytorch_model)(\.fp16)?"
                         r"(-\d{5}-of-\d{5})?\.(safetensors|bin)", p.name)
        if m:
            out.setdefault(f"{m.group(1)}{m.group(2) or ''}.{m.group(4)}", []).append(p.name)
    return out


def _check_sharded(d: Path, stem: str, suffix: str, variant: str = "") -> None:
    """Shards ``stem[.variant]-0000i-of-0000N.suffix`` numbered 1..N, and an index naming exactly them."""
    shards = sorted(p.name for p in d.iterdir() if p.name.startswith(f"{stem}{variant}-") and SHARD.search(p.name)
                    and p.name.endswith(suffix))
    assert len(shards) >= 2, (d, shards)
    n = int(SHARD.search(shards[0]).group(2))
    assert [int(SHARD.search(s).group(1)) for s in shards] == list(range(1, n + 1)), shards
    index = json.loads((d / f"{stem}{suffix}.index{variant}.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards


def _check_single(d: Path, stem: str, suffix: str, variant: str = "") -> None:
    assert (d / f"{stem}{variant}{suffix}").is_file(), sorted(os.listdir(d))


def _check_layout(name: str, d: Path) -> None:
    entry = by_name(name)
    stem = STEM.get(entry.library, "model")
    fams = _families(d)
    layout = entry.layout
    if layout in ("single", "component"):
        assert list(fams) == [f"{stem}.safetensors"] and fams[f"{stem}.safetensors"] == [f"{stem}.safetensors"], fams
    elif layout == "sharded":
        assert list(fams) == [f"{stem}.safetensors"], fams
        _check_sharded(d, stem, ".safetensors")
    elif layout == "variant":
        assert list(fams) == [f"{stem}.fp16.safetensors"], fams
        if "sharded" in name:
            _check_sharded(d, stem, ".safetensors", ".fp16")
        else:
            _check_single(d, stem, ".safetensors", ".fp16")
    elif layout == "variant-beside-main":
        assert sorted(fams) == [f"{stem}.fp16.safetensors", f"{stem}.safetensors"], fams
        check = _check_sharded if "sharded" in name else _check_single
        check(d, stem, ".safetensors")
        check(d, stem, ".safetensors", ".fp16")
    elif layout == "bin":
        bin_stem = "pytorch_model" if entry.library == "transformers" else stem
        assert list(fams) == [f"{bin_stem}.bin"] and fams[f"{bin_stem}.bin"] == [f"{bin_stem}.bin"], fams
    elif layout == "bin-sharded":
        assert list(fams) == ["pytorch_model.bin"], fams
        _check_sharded(d, "pytorch_model", ".bin")
    elif layout in ("pipeline", "pipeline-variant"):
        index = json.loads((d / "model_index.json").read_text())
        assert index["_class_name"] == "StableDiffusionPipeline"
        for component in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
            assert index[component][0] in ("diffusers", "transformers") and (d / component).is_dir()
        for component, stem_ in (("unet", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                                 ("text_encoder", "model")):
            sub = _families(d / component)
            want = [f"{stem_}.fp16.safetensors", f"{stem_}.safetensors"] if layout == "pipeline-variant" else [
                f"{stem_}.safetensors"]
            assert sorted(sub) == want, (component, sub)
            if "sharded" in name:
                _check_sharded(d / component, stem_, ".safetensors")
    elif layout == "st-root":
        modules = json.loads((d / "modules.json").read_text())
        assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Dense", "3_Normalize"]
        assert (d / "sentence_bert_config.json").is_file() and (d / "model.safetensors").is_file()
        assert (d / "2_Dense" / "model.safetensors").is_file() and (d / "1_Pooling" / "config.json").is_file()
    elif layout == "adapter":
        assert (d / "adapter_config.json").is_file()
        want = "adapter_model.bin" if name.endswith("-bin") else "adapter_model.safetensors"
        assert sorted(p.name for p in d.iterdir() if p.name.startswith("adapter_model")) == [want]
    elif layout in ("dcp", "dcp-nested"):
        ranks = 2 if "fsdp2" in name else 1
        assert sorted(os.listdir(d)) == [".metadata", *[f"__{r}_0.distcp" for r in range(ranks)]]
    elif layout == "trainer":
        ckpt = d / "checkpoint-2"
        assert os.listdir(d) == ["checkpoint-2"]
        for f in ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                  "trainer_state.json", "training_args.bin"):
            assert (ckpt / f).is_file(), f
        assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 2
    elif layout == "hf-cache":
        _check_hf_cache(d)
    elif layout == "accelerate-state":
        assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= set(os.listdir(d))
    else:
        raise AssertionError(f"{name}: layout {layout!r} has no check")


def _check_hf_cache(d: Path) -> None:
    from ecosystem.transformers_layouts import COMMIT, REPO_FOLDER, etag

    repo = d / REPO_FOLDER
    assert (repo / "refs" / "main").read_text() == COMMIT
    snapshots = sorted(os.listdir(repo / "snapshots"))
    assert len(snapshots) == 2 and COMMIT in snapshots
    blobs = set(os.listdir(repo / "blobs"))
    used = set()
    for snap in snapshots:
        for p in (repo / "snapshots" / snap).iterdir():
            target = os.readlink(p)
            assert p.is_symlink() and target == f"../../blobs/{Path(target).name}", (p, target)
            assert etag(p.name, p.read_bytes()) == Path(target).name  # the blob is named by its content
            used.add(Path(target).name)
            assert (d / ".locks" / REPO_FOLDER / f"{Path(target).name}.lock").is_file()
    assert used == blobs
    _check_sharded(repo / "snapshots" / COMMIT, "model", ".safetensors")
    assert (repo / ".no_exist" / COMMIT / "model.safetensors").is_file()


# -- the tests -----------------------------------------------------------------------------------


def test_ecosystem_fixture_builds_every_installed_entry(ecosystem: dict[str, Path]) -> None:
    """First, so the whole corpus is built at once (the two-rank DCP builds run beside the others)."""
    assert set(ecosystem) == {n for n in NAMES if not missing_libraries(n)}
    for name, d in ecosystem.items():
        assert d.is_dir() and any(d.iterdir()), name
        assert d.name == dirname(name)


@pytest.mark.parametrize("name", NAMES)
def test_entry_reloads_bit_exactly(name: str, build_one) -> None:
    _require(name)
    entry = by_name(name)
    d = build_one(name)
    before = _tree(d)
    ref = reference(name)
    loaded = entry.load(d)
    assert loaded, f"{name}: the loader returned no tensors"
    problems = compare(ref.tensors, loaded)
    assert not problems, problems[:20]
    assert ref.parameters == entry.parameters
    assert (entry.forward is None) == (ref.output is None)
    if entry.forward is not None:
        out = entry.forward(d)
        assert out.numel() > 0
        problems = compare({"output": ref.output}, {"output": out})
        assert not problems, f"{name}: the reloaded model computes otherwise: {problems}"
    _check_layout(name, d)
    assert _tree(d) == before, f"{name}: loading changed the directory"


def test_registry() -> None:
    assert len(set(NAMES)) == len(NAMES)
    assert {e.library for e in ENTRIES} == set(LIBRARIES)
    for e in ENTRIES:
        assert e.name.split("/")[0] == e.library and e.notes, e.name
        assert by_name(e.name) is e
    with pytest.raises(KeyError, match="no corpus entry"):
        by_name("transformers/nope")
    assert len({m.cls for m in MODELS.values()}) >= 30
    assert {f"transformers/{t}" for t in MODELS} <= {e.name for e in ENTRIES if e.layout == "single"}
    layouts = {e.layout for e in ENTRIES}
    assert {"single", "sharded", "variant", "variant-beside-main", "bin", "bin-sharded", "pipeline", "component",
            "st-root", "adapter", "dcp", "dcp-nested", "trainer", "hf-cache"} <= layouts


def test_fresh_copy_keeps_the_cache_links_working(build_one, tmp_path: Path) -> None:
    name = "transformers/hf-cache"
    _require(name)
    src = build_one(name)
    dst = fresh_copy(src, tmp_path / "cache")
    assert _tree(dst) == _tree(src)
    links = [p for p in dst.rglob("*") if p.is_symlink()]
    assert links and all(p.resolve().is_relative_to(dst.resolve()) for p in links)
    assert not compare(by_name(name).load(src), by_name(name).load(dst))
    with pytest.raises(FileExistsError):
        fresh_copy(src, dst)


@pytest.mark.parametrize("name", ["transformers/llama-fp16-beside-main-sharded", "diffusers/pipeline",
                                  "sentence-transformers/root", "peft/dora", "transformers/hf-cache"])
def test_builds_are_reproducible(name: str, build_one, tmp_path: Path) -> None:
    """Building an entry again gives the same files, byte for byte (seeds fixed, nothing time-stamped)."""
    _require(name)
    assert _tree(build(name, tmp_path / "again")) == _tree(build_one(name))
