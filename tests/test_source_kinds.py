"""The source-kind registry (``ckptctl/sources/kinds.py``): every kind is wired everywhere (its
hooks exist, its verify codes are documented, help and ``--only`` name it in every command that
takes it), a half-added kind is reported naming what is missing, and export, inspect and verify
choose the same kind for the same path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptctl.inspect import inspect_path
from ckptctl.sources import kinds as K
from ckptctl.sources import open_source
from ckptctl.sources.kinds import ONLY_CHOICES
from ckptctl.verify.context import VerifyOptions
from ckptctl.verify.pipeline import verify_path
from tests.support import REPO
from tests.support.cli import invoke
from tests.test_megatron_build import NEEDS_MEGATRON, iteration, megatron_ckpts  # noqa: F401 - the fixture
from tests.test_zero_build import NEEDS_DEEPSPEED, ckpt, step, zero_ckpts  # noqa: F401 - the fixture

CODES_DOC = (REPO / "docs" / "VERIFY_CODES.md").read_text()
COMMANDS_WITH_ONLY = ("export", "inspect")


def gaps(kind: K.Kind, help_texts: dict[str, str]) -> list[str]:
    """What ``kind`` lacks to be a complete source kind, each named."""
    out = []
    hooks = ("locate", "open", "inspect", "verify") if kind.locate else ("open", "inspect", "verify")
    for which in hooks:
        try:
            fn = kind.hook(which)
        except (ImportError, AttributeError, ValueError) as exc:
            out.append(f"{kind.name}: its {which} hook {getattr(kind, which)!r} does not resolve ({exc})")
            continue
        if not callable(fn):
            out.append(f"{kind.name}: its {which} hook {getattr(kind, which)!r} is not callable")
    if not kind.codes:
        out.append(f"{kind.name}: no verify codes")
    out += [f"{kind.name}: verify code {c} is not in docs/VERIFY_CODES.md" for c in kind.codes if f"`{c}`" not in CODES_DOC]
    if not kind.summary.strip():
        out.append(f"{kind.name}: no one-line description for help")
    if kind.locate and not (kind.expect and kind.expect_hint):
        out.append(f"{kind.name}: no refusal for --only {kind.name} on a path that is not one")
    out += [f"{kind.name}: `ckptctl {cmd} --help` does not offer it for --only"
            for cmd, text in help_texts.items() if kind.name not in text]
    if kind.name not in ONLY_CHOICES:
        out.append(f"{kind.name}: not among --only's choices")
    return out


@pytest.fixture(scope="module")
def help_texts() -> dict[str, str]:
    out = {}
    for cmd in COMMANDS_WITH_ONLY:
        r = invoke(cmd, "--help", env={"COLUMNS": "400"})
        assert r.exit_code == 0, r.stderr
        out[cmd] = r.stdout
    return out


def test_every_registered_kind_is_complete(help_texts):
    assert [g for k in K.KINDS for g in gaps(k, help_texts)] == []


def test_a_half_added_kind_is_reported_naming_what_is_missing(help_texts):
    half = K.Kind("nemo", "NeMo distributed checkpoint", "ckptctl.sources.nemo.locate:find_nemo",
                  "ckptctl.sources.nemo.source:open_location", "ckptctl.inspect_kinds:inspect_nemo",
                  "ckptctl.verify.zero:check_zero", ("nemo.checkpoint",))
    found = gaps(half, help_texts)
    assert any("its locate hook" in g for g in found) and any("its open hook" in g for g in found)
    assert any("its inspect hook" in g for g in found) and not any("its verify hook" in g for g in found)
    assert any("nemo.checkpoint is not in docs/VERIFY_CODES.md" in g for g in found)
    assert any("no refusal for --only nemo" in g for g in found)
    assert {f"nemo: `ckptctl {c} --help` does not offer it for --only" for c in COMMANDS_WITH_ONLY} <= set(found)
    assert "nemo: not among --only's choices" in found


def test_the_probe_order_is_located_kinds_first_then_the_layouts_families():
    located = [k.locate is not None for k in K.KINDS]
    assert located == sorted(located, reverse=True)
    assert K.FAMILIES == ("safetensors", "pytorch", "peft", "dcp")
    from ckptctl import layout as L

    assert set(K.FAMILIES) == {L.SAFETENSORS, L.PYTORCH, L.PEFT, L.DCP}


def test_only_names_a_located_kind_that_is_not_there_is_a_usage_error_in_every_command(tmp_path):
    src = tmp_path / "plain"
    src.mkdir()
    save_file({"w": torch.zeros(2)}, str(src / "model.safetensors"))
    for kind in K.LOCATED:
        for argv in (("export", src, tmp_path / "out"), ("inspect", src)):
            r = invoke(*argv, "--only", kind.name)
            assert r.exit_code == 2, (kind.name, argv, r.stderr)
            assert f"{src} {kind.expect}" in r.stderr and kind.expect_hint in r.stderr
    assert not (tmp_path / "out").exists()


def _plain_kinds(root: Path) -> dict[str, Path]:
    """One checkpoint of each layout family kind and of DCP-HF, written by the libraries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    out = {}
    state = {"model.embed.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    out["safetensors"] = root / "st"
    out["safetensors"].mkdir()
    save_file(state, str(out["safetensors"] / "model.safetensors"))
    out["pytorch"] = root / "pt"
    out["pytorch"].mkdir()
    torch.save(state, out["pytorch"] / "pytorch_model.bin")
    out["peft"] = root / "adapter"
    out["peft"].mkdir()
    save_file({"base_model.model.q.lora_A.weight": torch.randn(2, 4), "base_model.model.q.lora_B.weight": torch.zeros(4, 2)},
              str(out["peft"] / "adapter_model.safetensors"))
    (out["peft"] / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"], "base_model_name_or_path": None}))
    out["dcp"] = root / "dcp"
    dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=str(out["dcp"]))
    out["dcp-hf"] = root / "dcphf"
    dcp.save({k: v.clone() for k, v in state.items()},
             storage_writer=HuggingFaceStorageWriter(path=str(out["dcp-hf"] / "sharded"), save_distributed=True))
    return out


def _same_kind(path: Path, expected: str) -> None:
    with open_source(path) as src:
        exported = src.kind
    inspected = inspect_path(path).kind
    assert (exported, inspected) == (expected, expected), path
    for kind in K.KINDS:  # --only of the kind chosen reads the same; a located kind, asked, is found
        if kind.name == expected:
            with open_source(path, only=kind.name) as src:
                assert src.kind == expected
            assert inspect_path(path, only=kind.name).kind == expected


def test_export_and_inspect_choose_the_same_kind_for_each_layout_fixture(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled ... single process"
        fixtures = _plain_kinds(tmp_path)
    for expected, path in fixtures.items():
        _same_kind(path, expected)
    res = verify_path(fixtures["dcp-hf"])
    assert not [f for f in res.findings if f.severity == "error"], res.findings


@NEEDS_DEEPSPEED
def test_export_inspect_and_verify_choose_zero_for_each_zero_fixture(zero_ckpts):
    for name, root in sorted(zero_ckpts.items()):
        _same_kind(ckpt(root), "zero")
        _same_kind(step(root), "zero")
        for path in (ckpt(root), step(root)):  # the step folder holds no HF weights: not dir.no_weights
            res = verify_path(path, options=VerifyOptions(static=True))
            codes = {f.code for f in res.findings}
            assert "zero.checkpoint" in codes and "dir.no_weights" not in codes, (name, path, res.findings)


@NEEDS_DEEPSPEED
def test_verify_recursive_finds_a_zero_checkpoint_without_hf_weights_once(zero_ckpts, tmp_path):
    """A Trainer output whose checkpoint-N holds only the ZeRO state (ZeRO-3 without a gathered
    model.safetensors): --recursive finds checkpoint-N, verifies it as ZeRO, and does not verify
    its step folder again on its own."""
    import shutil

    out = tmp_path / "output"
    shutil.copytree(ckpt(zero_ckpts["s3_fp32"]), out / "checkpoint-3")
    (out / "checkpoint-3" / "model.safetensors").unlink()
    r = invoke("verify", "--recursive", "--static", "--json", out)
    doc = json.loads(r.stdout)
    assert [res["path"] for res in doc["results"]] == [str(out / "checkpoint-3")], r.stdout
    codes = {f["code"] for res in doc["results"] for f in res["findings"]}
    assert r.exit_code == 0 and "zero.checkpoint" in codes and "dir.no_weights" not in codes, r.stdout


@NEEDS_MEGATRON
def test_export_inspect_and_verify_choose_megatron_for_each_megatron_fixture(megatron_ckpts):
    for name, root in sorted(megatron_ckpts.items()):
        for path in (root, next(p for p in root.iterdir() if p.name.startswith("iter_"))):
            _same_kind(path, "megatron")
            r = invoke("verify", path, "--static", "--json")
            doc = json.loads(r.stdout)
            codes = {f["code"] for res in doc["results"] for f in res["findings"]}
            assert r.exit_code == 0 and "megatron.checkpoint" in codes, (name, r.stdout)
            assert "dir.no_weights" not in codes


def test_a_kind_is_read_only_when_chosen(tmp_path):
    """Exporting a plain safetensors checkpoint imports no other kind's reader."""
    import subprocess
    import sys

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    code = ("import sys; from ckptctl.sources import open_source\n"
            f"src = open_source({str(tmp_path)!r}); src.close()\n"
            "print(sorted(m for m in sys.modules if m.startswith('ckptctl.sources.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    loaded = json.loads(out.replace("'", '"'))
    for kind in ("zero", "megatron"):
        readers = [m for m in loaded if m.startswith(f"ckptctl.sources.{kind}.") and not m.endswith(".locate")]
        assert readers == [], readers
    assert "ckptctl.sources.dcp.source" not in loaded


def _megatron_copy(megatron_ckpts: dict[str, Path], tmp_path: Path) -> Path:
    import shutil

    src = tmp_path / "run"
    shutil.copytree(megatron_ckpts["llama_tp2"], src)
    return src


def _verify_codes(path: Path) -> tuple[int, set[str]]:
    r = invoke("verify", path, "--static", "--json")
    doc = json.loads(r.stdout)
    return r.exit_code, {f["code"] for res in doc["results"] for f in res["findings"]}


@NEEDS_MEGATRON
def test_verify_of_a_megatron_checkpoint_no_mapping_covers_passes_with_a_note(megatron_ckpts, tmp_path):
    import argparse

    src = _megatron_copy(megatron_ckpts, tmp_path)
    common = iteration(src) / "common.pt"
    obj = torch.load(common, weights_only=False)
    obj["args"] = argparse.Namespace(**{**vars(obj["args"]), "swiglu": False})  # a GELU MLP: no family has it
    torch.save(obj, common)
    code, codes = _verify_codes(src)
    assert code == 0 and {"megatron.not_mapped", "megatron.checkpoint"} <= codes, codes
    r = invoke("export", src, tmp_path / "out")  # the export refuses what verify notes
    assert r.exit_code == 2 and "swiglu" in r.stderr and not (tmp_path / "out").exists()


@NEEDS_MEGATRON
def test_verify_of_a_damaged_megatron_checkpoint_fails_naming_it(megatron_ckpts, tmp_path):
    src = _megatron_copy(megatron_ckpts, tmp_path)
    shard = sorted(iteration(src).glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size // 2)
    code, codes = _verify_codes(src)
    assert code == 1 and "megatron.damaged" in codes and "megatron.checkpoint" not in codes, codes
    (src / "latest_checkpointed_iteration.txt").write_text("99\n")  # names an iteration that is not there
    code, codes = _verify_codes(src)
    assert code == 1 and "megatron.damaged" in codes, codes
