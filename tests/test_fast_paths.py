"""One fast-path convention (``ckptctl/fastpaths.py``): every fast path has one switch, each
switch is read through ``fastpaths.enabled`` and does switch its path off, and README's table of
environment variables lists every ``CKPTCTL_`` variable the package reads."""

from __future__ import annotations

import re

import pytest
import torch

from ckptctl import fastpaths
from tests.support import REPO

README = (REPO / "README.md").read_text()
SOURCES = sorted((REPO / "ckptctl").rglob("*.py"))


def _table_variables() -> set[str]:
    section = README[README.index("### Environment variables"):]
    section = section[:section.index("\n### ", 1)]
    return set(re.findall(r"`(_?CKPTCTL_[A-Z_]+)", section))


def test_every_variable_the_package_reads_is_in_readmes_table():
    read = {m for p in SOURCES for m in re.findall(r"\b_?CKPTCTL_[A-Z][A-Z_]+", p.read_text())}
    read -= {"CKPTCTL_FAST_"}  # never a whole name
    assert {"CKPTCTL_DEBUG", "CKPTCTL_FAST_METADATA"} <= read  # the scan sees them
    assert sorted(read - _table_variables()) == []
    assert sorted(_table_variables() - read) == []


def test_each_fast_path_has_one_switch_read_in_one_place():
    envs = [f.env for f in fastpaths.FAST_PATHS.values()]
    assert len(set(envs)) == len(envs) and all(e.startswith("CKPTCTL_FAST_") for e in envs)
    for env in envs:  # a string nowhere else in the package (docs may name it): everyone asks fastpaths.enabled
        spelled = [p.relative_to(REPO).as_posix() for p in SOURCES if f'"{env}"' in p.read_text()]
        assert spelled == ["ckptctl/fastpaths.py"], (env, spelled)


@pytest.mark.parametrize("name", sorted(fastpaths.FAST_PATHS))
def test_the_switch_turns_its_path_off(name, monkeypatch):
    env = fastpaths.FAST_PATHS[name].env
    monkeypatch.delenv(env, raising=False)
    assert fastpaths.enabled(name)
    monkeypatch.setenv(env, "0")
    assert not fastpaths.enabled(name)
    monkeypatch.setenv(env, "1")
    assert fastpaths.enabled(name)


def test_pieces_switch_streams_dcp_hf_tensors(tmp_path, monkeypatch):
    """The pieces path on: the tensor's bytes are kernel-copied ranges; off: streamed (no pieces);
    the same tensors either way."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from ckptctl.sources import open_source

    state = {"model.embed.weight": torch.randn(64, 32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(path=str(tmp_path / "sharded"), save_distributed=True))
    seen = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(fastpaths.FAST_PATHS["pieces"].env, flag)
        with open_source(tmp_path) as src:
            seen[flag] = {t.name: (t.dtype, t.shape, bool(t.pieces)) for t in src.tensors}
    assert all(p for *_, p in seen["1"].values()) and not any(p for *_, p in seen["0"].values())
    assert {k: v[:2] for k, v in seen["1"].items()} == {k: v[:2] for k, v in seen["0"].items()}
