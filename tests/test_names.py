"""The one module of file-name rules: weights, variants, indexes, safe members, leftovers."""

from __future__ import annotations

import pytest

from ckptctl.format import names as N


@pytest.mark.parametrize("name,parts", [
    ("model.safetensors", ("model", "safetensors", None, None)),
    ("model-00001-of-00002.safetensors", ("model", "safetensors", None, (1, 2))),
    ("model.fp16.safetensors", ("model", "safetensors", "fp16", None)),
    ("model.fp16-00002-of-00003.safetensors", ("model", "safetensors", "fp16", (2, 3))),
    ("pytorch_model-00001-of-00002.bin", ("pytorch_model", "bin", None, (1, 2))),
    ("diffusion_pytorch_model.fp16.safetensors", ("diffusion_pytorch_model", "safetensors", "fp16", None)),
    ("diffusion_pytorch_model-00001-of-00002.bin", ("diffusion_pytorch_model", "bin", None, (1, 2))),
    ("adapter_model.safetensors", ("adapter_model", "safetensors", None, None)),
])
def test_weights_names_round_trip(name: str, parts: tuple) -> None:
    w = N.parse_weights_name(name)
    assert w is not None and (w.stem, w.ext, w.variant, w.shard) == parts
    assert w.name == name


@pytest.mark.parametrize("name", ["model.safetensors.bak", "optimizer.safetensors", "mm_projector.safetensors",
                                  "model-1-of-2.safetensors", "model-00001-of-?????.safetensors", "modelXsafetensors",
                                  "model.fp-16.safetensors", "model.pt"])
def test_not_weights_names(name: str) -> None:
    assert N.parse_weights_name(name) is None


def test_index_names_follow_add_variant() -> None:
    # transformers/diffusers _add_variant inserts the variant before the last extension
    assert N.index_name("model", "safetensors", variant="fp16") == "model.safetensors.index.fp16.json"
    assert N.parse_index_name("model.safetensors.index.fp16.json") == ("model", "safetensors", "fp16")
    assert N.parse_index_name("diffusion_pytorch_model.bin.index.json") == ("diffusion_pytorch_model", "bin", None)
    assert N.parse_index_name("model.fp16.safetensors.index.json") is None


@pytest.mark.parametrize("name,ok", [
    ("model-00001-of-00002.safetensors", True), ("sub/x.safetensors", True), ("", False), ("/etc/passwd", False),
    ("../x.safetensors", False), ("a/../../x", False), ("a\\b", False), ("C:x", False), ("a\0b", False),
    ("a//b", False), ("./a", False), (3, False),
])
def test_member_rule(name: object, ok: bool) -> None:
    assert (N.member_problem(name) is None) is ok


@pytest.mark.parametrize("name,is_dir,kind", [
    ("model-00001-of-?????.safetensors", False, "temp-shards"),
    (".tmpAb12Cd", False, "safetensors-tmp"),
    ("blob.incomplete", False, "incomplete"),
    ("tmp-checkpoint-500", True, "trainer-tmp"),
    ("step.orbax-checkpoint-tmp-1700000000", True, "orbax"),
    ("_tmp_out.0123456789abcdef-0123abcd", True, "staging"),
    # not provably anyone's leftover: a user's folders and files
    ("_tmp_scratch", True, None), (".tmpl", True, None), (".tmpAb12Cd", True, None), (".tmpAb12C", False, None),
    ("tmp-checkpoint-500", False, None), ("tmp-checkpoint-final", True, None), ("notes.txt", False, None),
])
def test_leftover_table(name: str, is_dir: bool, kind: str | None) -> None:
    assert N.leftover_kind(name, is_dir=is_dir) == kind


def test_safetensors_tmp_needs_a_safetensors_neighbour() -> None:
    assert N.leftover_kind(".tmpAb12Cd", is_dir=False, beside_safetensors=False) is None


def test_staging_name_parses_back() -> None:
    name = N.staging_name("ckpt.v2")
    dest, stamp = N.parse_staging_name(name)
    assert dest == "ckpt.v2" and stamp > 0


def test_the_manifest_name_is_the_one_the_manifest_module_writes() -> None:
    """verify finds the manifest by the name in this module (without importing the manifest
    module and its hashing threads); the manifest module writes its file under that name."""
    from ckptctl import manifest

    assert manifest.MANIFEST_NAME == N.MANIFEST_NAME
