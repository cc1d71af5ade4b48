"""Synthetic Llama-shaped checkpoints for the benchmarks.

    python -m bench.gen OUT --size 2GB --dtype bf16 --shards 4      # sharded safetensors + index
    python -m bench.gen OUT --size 500MB --single                   # one model.safetensors
    python -m bench.gen OUT --size 500MB --bin                      # pytorch_model.bin
    python -m bench.gen OUT --tiny-shards 1000 --layers 1000        # 1,000 shards of tiny tensors

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


def generate(out: str | os.PathLike[str], spec: Spec) -> Path:
    """Write the checkpoint described by ``spec`` to ``out`` (which must not exist) and stamp it."""
    out = Path(out)
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
        weight_map = {}
        for k, group in enumerate(split(specs, n), 1):
            name = f"model-{k:05d}-of-{n:05d}.safetensors"
            write_safetensors(out / name, group, block, itemsize)
            weight_map.update((s.name, name) for s in group)
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _stamp(out).write_text(json.dumps(_stamp_data(spec)) + "\n")
    return out


def ensure(spec: Spec, out: str | os.PathLike[str] | None = None) -> Path:
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


def _stamp_data(spec: Spec) -> dict:
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="keep OUT if its stamp matches")
    a = ap.parse_args(argv)
    if a.single and a.bin:
        ap.error("--single and --bin are exclusive")
    spec = Spec(parse_size(a.size), a.dtype, a.shards, a.single, a.bin, a.layers, a.tiny_shards, a.seed)
    if a.reuse:
        ensure(spec, a.out)
    elif a.out.exists():
        ap.error(f"{a.out} exists (remove it, or pass --reuse)")
    else:
        generate(a.out, spec)


if __name__ == "__main__":
    main()
