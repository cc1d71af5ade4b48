"""Every command on every layout of the corpus (issue 12): ``inspect`` counts what the library holds,
``export`` and ``resave --max-shard-size`` give a directory the library's own loader reloads
bit-exactly (same output), ``resave --repair`` of a sound checkpoint writes nothing, and what is not
one model (a training state, a multi-component root) is refused with the next step.

In-process library calls throughout (the corpus builds are shared, session-scoped); one subprocess
per command kind where the exit code and the messages are the point."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ecosystem import ENTRIES, by_name, compare, dirname, fresh_copy
from ckptctl.api import export
from ckptctl.errors import UsageError
from ckptctl.inspect import inspect_path
from ckptctl.resave import resave
from ckptctl.write.options import ExportOptions
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


def _exportable(name: str) -> None:
    layout = by_name(name).layout
    if layout in ROOTS:
        pytest.skip("a multi-component root is refused by export (test_export_refuses_multi_component_roots)")
    if layout == "variant-beside-main":
        pytest.skip("export writes one family (the main one): the entry's loader reads both families")
    if name == "transformers/hf-cache":
        pytest.skip("the entry's loader reads a hub cache root; its snapshot is transformers/llama's checkpoint")


@pytest.mark.parametrize("name", NAMES)
def test_export_reloads_bit_exactly_with_the_library(name: str, build_one, tmp_path: Path) -> None:
    _exportable(name)
    d = build_one(name)
    e = by_name(name)
    out = tmp_path / "out"
    dest = out / "checkpoint-2" if name == "transformers/trainer" else out
    export(_source(name, d), dest, ExportOptions(fsync=False), key=_key(name))
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
    assert compare(e.load(d), e.load(out)) == []
    if e.forward is not None:
        import torch

        assert torch.equal(e.forward(d), e.forward(out))
    if name == "transformers/trainer":  # the model only, never the training state
        assert not {"optimizer.pt", "scheduler.pt", "rng_state.pth"} & set(os.listdir(dest))


@pytest.mark.parametrize("name", NAMES)
def test_resave_max_shard_size_reloads_bit_exactly(name: str, build_one, tmp_path: Path) -> None:
    e = by_name(name)
    if e.layout in ADAPTERS | DCP or e.layout in ("pipeline", "pipeline-variant") or name == "transformers/hf-cache":
        pytest.skip("resave refuses adapters, DCP and pipeline roots (test_resave_refusals_name_the_command)")
    if name in ONE_FILE_LOADERS:
        pytest.skip(ONE_FILE_LOADERS[name])
    d = build_one(name)
    c = fresh_copy(d, tmp_path / "c")
    resave(_source(name, c), ExportOptions(max_shard_size="20KB", fsync=False))
    assert compare(e.load(d), e.load(c)) == []


@pytest.mark.parametrize("name", NAMES)
def test_repair_of_a_sound_checkpoint_writes_nothing(name: str, build_one, tmp_path: Path) -> None:
    e = by_name(name)
    if e.layout in ADAPTERS | DCP or e.layout in ("pipeline", "pipeline-variant"):
        pytest.skip("resave refuses adapters, DCP and pipeline roots (test_resave_refusals_name_the_command)")
    d = build_one(name)
    c = fresh_copy(d, tmp_path / "c")
    before = _tree(c)
    res = resave(_source(name, c), ExportOptions(fsync=False, max_shard_size=None), repair=True)
    assert res.unchanged and res.export.publish is None
    assert _tree(c) == before  # same files, same bytes, same inodes


def test_repair_cli_says_nothing_to_repair(build_one, tmp_path: Path) -> None:
    c = fresh_copy(build_one("diffusers/unet-fp16-beside-main-sharded"), tmp_path / "c")
    before = _tree(c)
    proc = run_ckptctl("resave", "--repair", c)
    assert proc.returncode == 0 and "nothing to repair" in proc.stdout, proc.stderr
    assert _tree(c) == before


@pytest.mark.parametrize("name", ["diffusers/pipeline", "sentence-transformers/root"])
def test_export_refuses_multi_component_roots(name: str, build_one, tmp_path: Path) -> None:
    proc = run_ckptctl("export", build_one(name), tmp_path / "out")
    assert proc.returncode == 2 and "root with several components" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["dcp/train-state", "dcp/fsdp2-train-state"])
def test_a_training_state_is_refused_without_key(name: str, build_one, tmp_path: Path) -> None:
    d = build_one(name)
    for argv in (("export", d, tmp_path / "out"), ("inspect", d)):
        proc = run_ckptctl(*argv)
        assert proc.returncode == 2, proc.stderr
        assert "top-level keys: model, optimizer, step" in proc.stderr and "--key" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_ckptctl("inspect", "--key", "model", "--json", d)
    assert proc.returncode == 0 and f'"parameters": {by_name(name).parameters}' in proc.stdout


@pytest.mark.parametrize("name,hint", [("peft/lora", "ckptctl export"), ("dcp/single", "ckptctl export"),
                                       ("diffusers/pipeline", "resave each component folder")])
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
