"""Export from Megatron-core ``torch_dist`` checkpoints (issue 32), judged by transformers' own
loader against Megatron's own forward.

The checkpoints are real (``tests/test_megatron_build.py``: megatron-core 0.16.1 on 2 Gloo ranks,
tensor-parallel 2, pipeline-parallel 2, expert-parallel 2; GQA, tied and untied heads, a QKV
bias, a mixture of experts; Adam's state beside the weights). The oracle is the logits of
Megatron's ``GPTModel`` forward on the loaded checkpoint; ``--names megatron`` is held to torch's
own ``dcp.load`` of every global tensor, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import invoke, staging_dirs
from tests.test_megatron_build import NAMES, NEEDS_MEGATRON, iteration, megatron_ckpts  # noqa: F401 - the fixture

pytestmark = NEEDS_MEGATRON
TOLERANCE = 1e-4  # a right mapping is within ~1e-6 in fp32; the usual mistakes miss by 1e-3 or more
ARCH = {"llama_tp2": "LlamaForCausalLM", "llama_pp2_tied": "LlamaForCausalLM", "qwen2_tp2": "Qwen2ForCausalLM",
        "mixtral_ep2": "MixtralForCausalLM"}


def _export(src: Path, dst: Path, *args: str) -> dict:
    r = invoke("export", src, dst, "--json", "--no-fsync", *args)
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def _logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture(scope="module")
def exported(megatron_ckpts, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each fixture exported once from its ``--save`` root (the tracker names the iteration)."""
    out = tmp_path_factory.mktemp("megatron-hf")
    return {name: (out / name, _export(megatron_ckpts[name], out / name)) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_transformers_gives_megatrons_own_logits(megatron_ckpts, exported, name):
    """transformers' loader on the export (its config.json built from the Megatron arguments)
    gives the logits Megatron's own forward gave on the saved checkpoint: GQA q/k/v split per
    query group, gate/up halves, RMSNorm epsilon, rotary base, QKV bias, tied head, experts."""
    dst, doc = exported[name]
    oracle = torch.load(megatron_ckpts[name] / "oracle_logits.pt")
    got = _logits(dst, oracle["tokens"])
    # the vocabulary padding removed, the NullTokenizer's EOD row (vocab_size + 1) kept
    assert got.shape == oracle["logits"].shape == (1, 12, 102)
    assert (got - oracle["logits"]).abs().max().item() < TOLERANCE
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["architectures"] == [ARCH[name]]
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]
    assert staging_dirs(dst.parent) == []
    tensors = _load(dst / "model.safetensors")
    assert ("lm_head.weight" in tensors) == (name != "llama_pp2_tied") and cfg["tie_word_embeddings"] == (
        name == "llama_pp2_tied")
    assert not any(n.startswith(("optimizer", "decoder", "embedding")) for n in tensors)
    assert doc["bytes_copied_by_kernel"] > 0


def test_tensor_parallel_column_shards_stream_and_row_runs_are_kernel_copies(exported):
    """``linear_proj``/``linear_fc2`` of a tensor-parallel save are column shards: they stream in
    windows; every other tensor (q/k/v and gate/up row runs included) is copied by the kernel."""
    _dst, doc = exported["llama_tp2"]
    o_proj_and_down = 2 * 64 * (64 + 96) * 4  # two layers of o_proj [64, 64] and down_proj [64, 96], fp32
    assert doc["bytes_streamed"] == o_proj_and_down
    _dst, doc = exported["llama_pp2_tied"]
    assert doc["bytes_streamed"] == 0


def test_the_oracle_catches_a_swapped_gate_and_up(megatron_ckpts, exported, tmp_path):
    """The logits check is strong enough: the same export with one layer's gate and up swapped
    misses Megatron's logits by far more than the tolerance."""
    from safetensors.torch import save_file

    dst, _doc = exported["llama_tp2"]
    shutil.copytree(dst, tmp_path / "bad")
    tensors = _load(dst / "model.safetensors")
    g, u = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    tensors[g], tensors[u] = tensors[u], tensors[g]
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    oracle = torch.load(megatron_ckpts["llama_tp2"] / "oracle_logits.pt")
    assert (_logits(tmp_path / "bad", oracle["tokens"]) - oracle["logits"]).abs().max().item() > 10 * TOLERANCE


def _dcp_globals(folder: Path, names: list[str], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """torch's own reader: every tensor ``dcp.load`` assembles from the checkpoint."""
    import torch.distributed.checkpoint as dcp

    out = {n: torch.empty(shapes[n], dtype=torch.float32) for n in names}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return out


@pytest.mark.parametrize("name", ["llama_tp2", "mixtral_ep2"])
def test_names_megatron_is_torchs_own_reading_of_every_model_tensor(megatron_ckpts, tmp_path, name):
    """``--names megatron`` from the iteration folder: every model tensor under its Megatron name,
    with its global (stacked, padded) shape and torch's bytes; no optimizer state, no config."""
    doc = _export(iteration(megatron_ckpts[name]), tmp_path / "out", "--names", "megatron")
    got = _load(tmp_path / "out" / "model.safetensors")
    want = _dcp_globals(iteration(megatron_ckpts[name]), sorted(got), {n: tuple(t.shape) for n, t in got.items()})
    assert "decoder.layers.self_attention.linear_qkv.weight" in got and not any(n.startswith("optimizer") for n in got)
    for n, t in got.items():
        assert torch.equal(t, want[n]), n
    assert doc["extras"] == [] and sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]


def test_dtype_bf16_is_the_fp32_export_converted(exported, megatron_ckpts, tmp_path):
    _export(megatron_ckpts["qwen2_tp2"], tmp_path / "bf16", "--dtype", "bf16")
    fp32 = _load(exported["qwen2_tp2"][0] / "model.safetensors")
    bf16 = _load(tmp_path / "bf16" / "model.safetensors")
    assert set(fp32) == set(bf16)
    for n, t in fp32.items():
        assert torch.equal(bf16[n], t.to(torch.bfloat16)), n
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("name,min_run", [("llama_tp2", None), ("llama_tp2", 1), ("mixtral_ep2", None)])
def test_pieces_equal_the_streamed_reference(megatron_ckpts, name, min_run):
    """The seam of the kernel-copy fast path: each tensor's pieces (``min_run=1``: the column
    shards' short runs too, as a large model's are) hold exactly the bytes the windowed assembly
    (``max_pieces=0``, the reference) streams."""
    from ckptctl.sources.megatron.locate import find_megatron
    from ckptctl.sources.megatron.source import MegatronSource

    loc = find_megatron(megatron_ckpts[name])
    fast = MegatronSource.open_location(loc, **({"min_run": min_run} if min_run else {}))
    ref = MegatronSource.open_location(loc, max_pieces=0)
    assert not any(t.pieces for t in ref.tensors) and sum(bool(t.pieces) for t in fast.tensors) > 10
    if name == "llama_tp2":  # column shards of 128-byte runs: streamed unless min_run allows them
        assert all(t.pieces for t in fast.tensors) == (min_run == 1)
    by_name = {t.name: t for t in ref.tensors}
    for t in fast.tensors:
        streamed = b"".join(bytes(c) for c in ref.chunks(by_name[t.name]))
        if t.pieces:
            raw = bytearray(t.nbytes)
            assert [p.dst_offset for p in t.pieces] == sorted(p.dst_offset for p in t.pieces)  # in output order
            assert sum(p.nbytes for p in t.pieces) == t.nbytes and len(list(t.pieces)) == len(t.pieces)
            for p in t.pieces:
                with open(p.file, "rb") as f:
                    f.seek(p.src_offset)
                    raw[p.dst_offset:p.dst_offset + p.nbytes] = f.read(p.nbytes)
            assert bytes(raw) == streamed, t.name
        else:
            assert b"".join(bytes(c) for c in fast.chunks(t)) == streamed, t.name


def test_a_two_rank_export_is_byte_identical_to_one_process(megatron_ckpts, exported, tmp_path):
    """The same export launched as 2 ranks (torchrun's environment, Gloo): the ranks share the
    writing of one checkpoint, and every file equals the single-process export byte for byte."""
    from ckptctl.manifest import sha256_file
    from tests.test_distributed import _launch

    one = exported["llama_tp2"][0]
    many = tmp_path / "many"
    outs = _launch(2, ["-m", "ckptctl", "export", str(megatron_ckpts["llama_tp2"]), str(many), "--json",
                       "--no-fsync"])
    assert all(rc == 0 for rc, _, _ in outs), outs
    assert json.loads(outs[0][1])["ok"] and outs[1][1] == ""
    assert sorted(os.listdir(one)) == sorted(os.listdir(many))
    for name in os.listdir(one):
        assert sha256_file(one / name) == sha256_file(many / name), name
    assert staging_dirs(tmp_path) == []
