"""Synthetic Llama-shaped checkpoints for the benchmarks.

    python -m bench.gen OUT --size 2GB --dtype bf16 --shards 4      # sharded safetensors + index
    python -m bench.gen OUT --size 500MB --single                   # one model.safetensors
    python -m bench.gen OUT --size 500MB --bin                      # pytorch_model.bin
    python -m bench.gen OUT --tiny-shards 1000 --layers 1000        # 1,000 shards of tiny tensors
    python -m bench.gen OUT --moe                                   # DeepSeek-V3's 163 shards, tiny tensors

Safetensors files are written here, byte by byte (header from ckptctl's encoder, then the data
streamed from one reusable block of normally distributed values), so memory stays bounded at any
size. ``--bin`` saves tensors that are views of a memory-mapped scratch safetensors file, so the
pickle is written from the page cache, not from a copy in memory. Cases call :func:`ensure`, which
reuses a checkpoint when its stamp file says it was generated with the same parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ckptctl.format import dtypes as dt
from ckptctl.format.header import encode_header
from ckptctl.format.tensor import TensorSpec
from rich import filesize

from ckptctl.sizes import parse_size

WORK = Path(__file__).resolve().parent / "work"
GEN_VERSION = 1  # bump when the output for the same parameters changes
BLOCK = 16 << 20  # bytes of the reusable data block
DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


@dataclass(frozen=True)
class Spec:
    """What to generate. ``tiny_shards`` > 0 ignores ``size`` and ``shards``."""

    size: int = 2 * 10**9
    dtype: str = "bf16"
    shards: int = 4
    single: bool = False
    bin: bool = False
    layers: int | None = None
    tiny_shards: int = 0
    seed: int = 0

    def name(self) -> str:
        """A directory name that says what the checkpoint is (used under ``bench/work``)."""
        if self.tiny_shards:
            return f"llama-tiny-{self.layers or 'auto'}L-{self.tiny_shards}shards-{self.dtype}"
        kind = "bin" if self.bin else "single" if self.single else f"{self.shards}shards"
        layers = f"-{self.layers}L" if self.layers else ""
        return f"llama-{filesize.decimal(self.size, precision=2).replace(' ', '')}-{self.dtype}-{kind}{layers}"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    head_dim: int

    def tensors(self, dtype: str) -> list[TensorSpec]:
        """In state-dict order, the order HF fills shards in."""
        h, i = self.hidden, self.intermediate
        out = [TensorSpec("model.embed_tokens.weight", dtype, (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [TensorSpec(p + f"self_attn.{x}_proj.weight", dtype, (h, h)) for x in "qkvo"]
            out += [TensorSpec(p + "mlp.gate_proj.weight", dtype, (i, h)),
                    TensorSpec(p + "mlp.up_proj.weight", dtype, (i, h)),
                    TensorSpec(p + "mlp.down_proj.weight", dtype, (h, i)),
                    TensorSpec(p + "input_layernorm.weight", dtype, (h,)),
                    TensorSpec(p + "post_attention_layernorm.weight", dtype, (h,))]
        out += [TensorSpec("model.norm.weight", dtype, (h,)),
                TensorSpec("lm_head.weight", dtype, (self.vocab, h))]
        return out

    def config(self, dtype: str) -> dict:
        heads = self.hidden // self.head_dim
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": dt.CONFIG_NAMES[dtype],
        }


def shape_for(params: int, layers: int | None = None) -> Shape:
    """A Llama-like shape with about ``params`` parameters (within a fraction of a percent for
    anything above a few MB): hidden size from the layer budget, vocab capped at 32,000, then the
    intermediate size takes up the rest."""
    layers = layers or max(2, min(80, round(params ** (1 / 3) / 62)))  # 1B -> 16, 7B -> 31
    approx = math.sqrt(0.8 * params / (12 * layers))
    step = 128 if approx >= 1024 else 64
    hidden = max(64, round(approx / step) * step)
    vocab = max(64, min(32000, round(0.2 * params / (2 * hidden) / 64) * 64))
    rest = params - 2 * vocab * hidden - hidden - layers * (4 * hidden * hidden + 2 * hidden)
    intermediate = max(8, rest // (3 * hidden * layers) // 8 * 8)
    return Shape(layers, hidden, intermediate, vocab, step)


def tiny_shape(shards: int, layers: int | None = None) -> Shape:
    """Enough layers for at least one tensor per shard, tiny tensors."""
    return Shape(max(layers or 0, math.ceil((shards - 3) / 9), 1), 64, 128, 1024, 64)


def split(specs: list[TensorSpec], n: int) -> list[list[TensorSpec]]:
    """Contiguous groups of about equal bytes, exactly ``n`` of them, none empty."""
    if not 1 <= n <= len(specs):
        raise ValueError(f"cannot split {len(specs)} tensors into {n} shards")
    total = sum(s.nbytes for s in specs)
    groups: list[list[TensorSpec]] = [[]]
    closed = current = 0
    for k, s in enumerate(specs):
        still_to_open = n - len(groups)
        if groups[-1] and still_to_open and (
                len(specs) - k == still_to_open
                or current + s.nbytes / 2 > (total - closed) / (still_to_open + 1)):
            closed += current
            groups.append([])
            current = 0
        groups[-1].append(s)
        current += s.nbytes
    return groups


def data_block(dtype: str, seed: int) -> memoryview:
    """BLOCK bytes of finite values ~ N(0, 0.02), as a weight matrix holds."""
    x = np.random.default_rng(seed).normal(0.0, 0.02, BLOCK // 4).astype(np.float32)
    if dtype == "BF16":
        y = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation: always a finite bf16
    elif dtype == "F16":
        y = x.astype(np.float16)
    else:
        y = x
    return memoryview(np.ascontiguousarray(y).tobytes())[:BLOCK]


def write_safetensors(path: Path, specs: list[TensorSpec], block: memoryview, itemsize: int) -> int:
    """Write one file; the data is the block, rotated by a different whole-element offset per
    chunk so no two chunks are identical. Returns the file size."""
    header, _ = encode_header(specs, {"format": "pt"})
    left = sum(s.nbytes for s in specs)
    chunk = 0
    with open(path, "wb") as f:
        f.write(header)
        while left:
            rot = (chunk * 4099 * itemsize) % len(block)
            for piece in (block[rot:], block[:rot]):
                piece = piece[:left]
                f.write(piece)
                left -= len(piece)
            chunk += 1
    return len(header) + sum(s.nbytes for s in specs)


def write_bin(out: Path, specs: list[TensorSpec], block: memoryview, itemsize: int) -> None:
    import torch

    scratch = out / ".scratch.safetensors"
    write_safetensors(scratch, specs, block, itemsize)
    header, infos = encode_header(specs, {"format": "pt"})
    tdtype = getattr(torch, dt.BY_NAME[specs[0].dtype].torch_name)
    try:
        with open(scratch, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            by_name = {t.name: t for t in infos}
            state = {}
            for s in specs:
                t = by_name[s.name]
                state[s.name] = torch.frombuffer(mm, dtype=tdtype, count=t.nbytes // itemsize,
                                                 offset=len(header) + t.begin).view(s.shape)
            torch.save(state, out / "pytorch_model.bin")
            del state
    finally:
        scratch.unlink()


@dataclass(frozen=True)
class MoeSpec:
    """DeepSeek-V3's tensor names and shard count (61 layers, the first 3 dense, 256 routed
    experts, fp8 weights each with its F32 ``weight_scale_inv``, the MTP layer 61), every tensor
    tiny: the metadata of a 671B checkpoint (91,929 tensors in 163 shards) with about 20 MB of
    data. ``width`` is the side of each square weight."""

    layers: int = 61
    dense: int = 3
    experts: int = 256
    shards: int = 163
    width: int = 20
    seed: int = 0

    def name(self) -> str:
        return f"moe-{self.layers}L-{self.experts}E-{self.shards}shards-w{self.width}"

    def tensors(self) -> list[TensorSpec]:
        w, out = self.width, [TensorSpec("model.embed_tokens.weight", "BF16", (4 * self.width, self.width))]

        def fp8(name: str) -> list[TensorSpec]:
            return [TensorSpec(name + ".weight", "F8_E4M3", (w, w)),
                    TensorSpec(name + ".weight_scale_inv", "F32", (1, 1))]

        for n in range(self.layers + 1):  # + the MTP layer
            p = f"model.layers.{n}."
            out += [*fp8(p + "self_attn.q_a_proj"), TensorSpec(p + "self_attn.q_a_layernorm.weight", "BF16", (w,)),
                    *fp8(p + "self_attn.q_b_proj"), *fp8(p + "self_attn.kv_a_proj_with_mqa"),
                    TensorSpec(p + "self_attn.kv_a_layernorm.weight", "BF16", (w,)),
                    *fp8(p + "self_attn.kv_b_proj"), *fp8(p + "self_attn.o_proj"),
                    TensorSpec(p + "input_layernorm.weight", "BF16", (w,)),
                    TensorSpec(p + "post_attention_layernorm.weight", "BF16", (w,))]
            if n < self.dense:
                out += [t for x in ("gate", "up", "down") for t in fp8(p + f"mlp.{x}_proj")]
                continue
            out += [TensorSpec(p + "mlp.gate.weight", "BF16", (self.experts, w)),
                    TensorSpec(p + "mlp.gate.e_score_correction_bias", "F32", (self.experts,))]
            out += [t for e in range(self.experts) for x in ("gate", "up", "down")
                    for t in fp8(p + f"mlp.experts.{e}.{x}_proj")]
            out += [t for x in ("gate", "up", "down") for t in fp8(p + f"mlp.shared_experts.{x}_proj")]
            if n == self.layers:
                out += [TensorSpec(p + "enorm.weight", "BF16", (w,)), TensorSpec(p + "hnorm.weight", "BF16", (w,)),
                        TensorSpec(p + "eh_proj.weight", "BF16", (w, 2 * w)),
                        TensorSpec(p + "embed_tokens.weight", "BF16", (4 * w, w)),
                        TensorSpec(p + "shared_head.norm.weight", "BF16", (w,)),
                        TensorSpec(p + "shared_head.head.weight", "BF16", (4 * w, w))]
        return out + [TensorSpec("model.norm.weight", "BF16", (w,)),
                      TensorSpec("lm_head.weight", "BF16", (4 * w, w))]

    def config(self) -> dict:
        w = self.width
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                "hidden_size": w, "intermediate_size": w, "moe_intermediate_size": w,
                "num_hidden_layers": self.layers, "num_nextn_predict_layers": 1,
                "first_k_dense_replace": self.dense, "n_routed_experts": self.experts, "n_shared_experts": 1,
                "num_attention_heads": 1, "num_key_value_heads": 1, "vocab_size": 4 * w,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}}


def write_sharded(out: Path, specs: list[TensorSpec], n: int, block: memoryview, itemsize: int) -> None:
    """``n`` shards named and indexed as ``save_pretrained`` does."""
    weight_map = {}
    for k, group in enumerate(split(specs, n), 1):
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        write_safetensors(out / name, group, block, itemsize)
        weight_map.update((s.name, name) for s in group)
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def generate(out: str | os.PathLike[str], spec: Spec | MoeSpec) -> Path:
    """Write the checkpoint described by ``spec`` to ``out`` (which must not exist) and stamp it."""
    out = Path(out)
    if isinstance(spec, MoeSpec):
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(spec.config(), indent=2) + "\n")
        # the data are bytes of a finite bf16 block: as fp8 e4m3 some of them read as NaN (0x7f,
        # 0xff), as real fp8 checkpoints never hold; deep verify's scan is not what this measures
        write_sharded(out, spec.tensors(), spec.shards, data_block("BF16", spec.seed), 4)
        _stamp(out).write_text(json.dumps(_stamp_data(spec)) + "\n")
        return out
    dtype = DTYPES[spec.dtype]
    itemsize = dt.BY_NAME[dtype].itemsize
    if spec.tiny_shards:
        shape, n = tiny_shape(spec.tiny_shards, spec.layers), spec.tiny_shards
    else:
        shape, n = shape_for(spec.size // itemsize, spec.layers), 1 if spec.single or spec.bin else spec.shards
    specs = shape.tensors(dtype)
    block = data_block(dtype, spec.seed)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(shape.config(dtype), indent=2) + "\n")
    if spec.bin:
        write_bin(out, specs, block, itemsize)
    elif spec.single:
        write_safetensors(out / "model.safetensors", specs, block, itemsize)
    else:
        write_sharded(out, specs, n, block, itemsize)
    _stamp(out).write_text(json.dumps(_stamp_data(spec)) + "\n")
    return out


def ensure(spec: Spec | MoeSpec, out: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint for ``spec`` (default ``bench/work/<spec.name()>``), generated if its stamp
    is missing or differs; a directory without a matching stamp is removed first."""
    out = Path(out) if out else WORK / spec.name()
    stamp = _stamp(out)
    if stamp.is_file() and json.loads(stamp.read_text()) == _stamp_data(spec) and out.is_dir():
        return out
    stamp.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    print(f"generating {out} ...", file=sys.stderr, flush=True)
    return generate(out, spec)


def _stamp(out: Path) -> Path:
    """Beside the checkpoint, not in it, so the directory holds only checkpoint files."""
    return out.with_name(out.name + ".stamp.json")


def _stamp_data(spec: Spec | MoeSpec) -> dict:
    return {"gen_version": GEN_VERSION, **asdict(spec)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output directory (must not exist unless --reuse)")
    ap.add_argument("--size", default="2GB", help="total tensor bytes, e.g. 2GB, 500MiB (default 2GB)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--single", action="store_true", help="one model.safetensors, no index")
    ap.add_argument("--bin", action="store_true", help="pytorch_model.bin (torch.save) instead")
    ap.add_argument("--layers", type=int, help="number of decoder layers (default from the size)")
    ap.add_argument("--tiny-shards", type=int, default=0, metavar="N", help="N shards of tiny tensors")
    ap.add_argument("--moe", action="store_true", help="DeepSeek-V3's names and 163 shards, tiny tensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="keep OUT if its stamp matches")
    a = ap.parse_args(argv)
    if a.single and a.bin:
        ap.error("--single and --bin are exclusive")
    spec: Spec | MoeSpec = (MoeSpec(seed=a.seed) if a.moe else
                            Spec(parse_size(a.size), a.dtype, a.shards, a.single, a.bin, a.layers, a.tiny_shards, a.seed))
    if a.reuse:
        ensure(spec, a.out)
    elif a.out.exists():
        ap.error(f"{a.out} exists (remove it, or pass --reuse)")
    else:
        generate(a.out, spec)


if __name__ == "__main__":
    main()
