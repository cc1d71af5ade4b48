"""The root writer (write/tree.py) through resave (--repair of a damaged root, --output, a dry run) and a root
export's dry run, on real library outputs (tests/ecosystem)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ecosystem import by_name, compare, fresh_copy
from ckptctl.api import export
from ckptctl.errors import UsageError
from ckptctl.write.options import ExportOptions
from ckptctl.resave import resave
from ckptctl.write.tree import is_root

pytest_plugins = ["ecosystem.fixtures"]


def _files(d: Path) -> dict[str, tuple[int, bytes]]:
    return {str((Path(b) / f).relative_to(d)): (os.lstat(Path(b) / f).st_ino, (Path(b) / f).read_bytes())
            for b, _, fs in os.walk(d) for f in fs}


def test_repair_of_a_root_repairs_each_component_and_publishes_once(build_one, tmp_path: Path) -> None:
    name = "diffusers/pipeline-sharded"
    c = fresh_copy(build_one(name), tmp_path / "c")
    (c / "tmp-checkpoint-1").mkdir()  # a Trainer's leftover at the root
    (c / "unet" / "diffusion_pytorch_model-00001-of-?????.safetensors").write_bytes(b"x" * 10)  # a temp shard
    index = c / "vae" / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(index.read_text().replace('"total_size": ', '"total_size": 1'))  # a wrong total_size
    untouched = {n: v for n, v in _files(c).items() if n.startswith(("text_encoder/", "scheduler/"))}
    res = resave(c, ExportOptions(fsync=False, max_shard_size=None), repair=True)
    assert not res.unchanged and res.publish == "exchange" and res.removed == []
    assert not (c / "tmp-checkpoint-1").exists()
    assert not list((c / "unet").glob("*-of-[?][?][?][?][?].safetensors"))
    assert any("total_size" in f for f in res.components["vae"].repair.fixes)
    assert {n: v for n, v in _files(c).items() if n.startswith(("text_encoder/", "scheduler/"))} == untouched
    e = by_name(name)
    assert compare(e.load(build_one(name)), e.load(c)) == []
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    again = resave(c, ExportOptions(fsync=False, max_shard_size=None), repair=True)
    assert again.unchanged and again.publish is None


def test_resave_root_into_an_output_is_an_independent_copy(build_one, tmp_path: Path) -> None:
    name = "sentence-transformers/root"
    src = build_one(name)
    before = _files(src)
    res = resave(src, ExportOptions(fsync=False, max_shard_size="20KB"), output=tmp_path / "out")
    assert res.publish == "rename" and set(res.components) == {"", "2_Dense"}
    assert _files(src) == before
    out = tmp_path / "out"
    assert all(os.lstat(Path(b) / f).st_nlink == 1 for b, _, fs in os.walk(out) for f in fs)
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    e = by_name(name)
    assert compare(e.load(src), e.load(out)) == []
    import torch

    assert torch.equal(e.forward(src), e.forward(out))
    with pytest.raises(UsageError):  # an existing output needs --overwrite
        resave(src, ExportOptions(fsync=False), output=out)


@pytest.mark.parametrize("name", ["diffusers/pipeline", "sentence-transformers/root"])
def test_dry_runs_of_a_root_write_nothing(name: str, build_one, tmp_path: Path) -> None:
    src = build_one(name)
    c = fresh_copy(src, tmp_path / "c")
    before = _files(c)
    res = export(src, tmp_path / "out", ExportOptions(dry_run=True))
    assert res.dry_run and res.publish is None and res.parameters == by_name(name).parameters
    res = resave(c, ExportOptions(dry_run=True, max_shard_size="20KB"))
    assert res.dry_run and res.publish is None and res.tensors == len(by_name(name).load(src))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"] and _files(c) == before


def test_is_root(build_one) -> None:
    assert is_root(build_one("diffusers/pipeline")) and is_root(build_one("sentence-transformers/root"))
    assert not is_root(build_one("diffusers/unet")) and not is_root(build_one("diffusers/pipeline") / "unet")


def test_the_one_model_writer_refuses_a_root_with_the_command_that_writes_it(build_one, tmp_path: Path) -> None:
    """``open_inputs`` (the multi-rank export's reader) writes one model: a root is sent to
    ``ckptctl export`` in one process, and nothing is written."""
    from ckptctl.write.inputs import open_inputs

    src = build_one("diffusers/pipeline")
    with pytest.raises(UsageError) as info:
        open_inputs(src, tmp_path / "out", ExportOptions())
    assert "unet" in info.value.message and "without torchrun" in (info.value.hint or "")
    assert not (tmp_path / "out").exists()


def test_the_resave_command_writes_a_root_whole(build_one, tmp_path: Path) -> None:
    """`ckptctl resave ROOT` hands a root to resave_root: a sound root's --repair writes nothing, a
    damaged one is repaired per component and shown per component; a re-shard reloads bit-exactly."""
    import json

    from tests.support.cli import run_ckptctl

    name = "diffusers/pipeline-sharded"
    c = fresh_copy(build_one(name), tmp_path / "c")
    before = _files(c)
    p = run_ckptctl("resave", c, "--repair", "--no-fsync")
    assert (p.returncode, p.stdout.strip()) == (0, f"nothing to repair: {c} is sound; nothing was written")
    assert _files(c) == before
    (c / "unet" / "diffusion_pytorch_model-00001-of-?????.safetensors").write_bytes(b"x" * 10)
    p = run_ckptctl("resave", c, "--repair", "--no-fsync")
    assert p.returncode == 0, p.stderr
    assert "fixed: unet: " in p.stdout and "unet/diffusion_pytorch_model" in p.stdout
    p = run_ckptctl("resave", c, "--max-shard-size", "20KB", "--no-fsync", "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 0 and doc["ok"] and doc["kind"] == "diffusers-pipeline"
    assert set(doc["components"]) == {"text_encoder", "unet", "vae"}
    e = by_name(name)
    assert compare(e.load(build_one(name)), e.load(c)) == []
