"""Real checkpoints for tests, written by the libraries users have: safetensors'
``save_file``, huggingface_hub's ``save_torch_state_dict``, ``torch.save``, and transformers
models built from their config classes. Deterministic: the same seed gives the same bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def state(seed: int, n: int = 6, rows: int = 64, cols: int = 32, dtype: torch.dtype = torch.float32,
          name: str = "layer.{i}.weight") -> dict[str, torch.Tensor]:
    """``n`` random ``rows x cols`` tensors named ``name.format(i=...)``, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return {name.format(i=i): torch.randn(rows, cols, generator=g).to(dtype) for i in range(n)}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_single(d: Path, tensors: dict[str, torch.Tensor], name: str = SINGLE) -> Path:
    """``d/model.safetensors`` written by ``safetensors.torch.save_file`` (``format: pt``)."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / name), metadata={"format": "pt"})
    return d / name


def write_sharded(d: Path, tensors: dict[str, torch.Tensor], per_shard: int | None = None, *,
                  max_shard_size: int | str | None = None) -> None:
    """A sharded checkpoint (index + ``model-0000k-of-0000n.safetensors``) written by
    huggingface_hub's own ``save_torch_state_dict``; the shard size is ``max_shard_size``, or the
    size of the first ``per_shard`` tensors."""
    from huggingface_hub import save_torch_state_dict

    if (per_shard is None) == (max_shard_size is None):
        raise TypeError("give exactly one of per_shard and max_shard_size")
    if per_shard is not None:
        max_shard_size = nbytes(dict(list(tensors.items())[:per_shard]))
    d.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({k: v.clone() for k, v in tensors.items()}, d, max_shard_size=max_shard_size)


def write_pickle(d: Path, tensors: dict[str, Any], name: str = "pytorch_model.bin") -> Path:
    """A pickle as ``torch.save`` writes it (what transformers wrote before safetensors)."""
    d.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, d / name)
    return d / name


def write_config(d: Path, model_type: str = "llama", dtype: str = "float32", **fields: Any) -> Path:
    """A ``config.json`` (indent 2, trailing newline, as transformers writes it)."""
    d.mkdir(parents=True, exist_ok=True)
    doc = {"model_type": model_type, "torch_dtype": dtype, **fields}
    (d / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    return d / "config.json"


def write_tiny_checkpoint(d: Path) -> Path:
    """The smallest checkpoint the CLI tests inspect and verify: two float32 tensors (36
    parameters) in ``model.safetensors`` and a ``config.json``."""
    write_single(d, {"model.embed.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)})
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    return d


TINY_LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(tie: bool = False, seed: int = 0, **overrides: Any) -> Any:
    """A tiny ``LlamaForCausalLM`` (eval mode) from ``LlamaConfig``, weights seeded by ``seed``."""
    import transformers

    cfg = transformers.LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": tie, **overrides})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def write_new_version(d: Path) -> Path:
    """The new version an overwrite test exports over an old one: four float32 tensors in one
    ``model.safetensors`` and a ``config.json``."""
    write_single(d, state(7, n=4))
    write_config(d)
    return d


def exported_old_version(src: Path, dest: Path) -> Path:
    """The destination's previous version: four other tensors exported to ``dest`` (built in
    ``src``), with a teammate's ``README.md`` beside them."""
    from tests.support.cli import run_ckptctl

    write_single(src, state(1, n=4))
    run_ckptctl("export", src, dest, check=True)
    (dest / "README.md").write_text("v1 notes")
    return dest


def write_raw_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file with ``(name, dtype, shape, bytes)`` tensors in the given order (not the
    official writer's, so offsets can be unaligned and dtypes anything the format names)."""
    import struct

    obj, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in tensors:
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    text = json.dumps(obj).encode()
    text += b" " * ((-len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))
