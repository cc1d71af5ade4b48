"""Reusable builders of clean and broken checkpoints (for ``verify`` and ``resave --repair`` tests).

Every ``make_<case>(d)`` creates the checkpoint directory ``d`` (absent or empty), breaks it in
exactly one way, and returns the finding code ``ckptctl verify d`` must report for it. Files that
belong *outside* the checkpoint (symlink targets, the base model of an adapter) are written to
siblings named ``<d.name>.<suffix>``. Everything is a real file written with safetensors, torch or
torch.distributed.checkpoint; nothing is mocked and nothing is downloaded. Only the pickle, DCP
and two-families builders import torch.

The clean base is a tiny Llama (``LLAMA``), written the way transformers writes it: three shards
plus an index (sorted keys, total_size and total_parameters) or one ``model.safetensors``,
``{"format": "pt"}`` metadata, and a config.json with LlamaConfig's fields;
``tests/test_verify_corpus.py`` checks that transformers loads it.

``CASES`` lists every builder with the verify options its code needs (``ARGS``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from safetensors.numpy import load_file, save_file

LLAMA = {"vocab_size": 64, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
         "intermediate_size": 32, "num_hidden_layers": 2, "max_position_embeddings": 32}
ST_INDEX = "model.safetensors.index.json"
MANIFEST = "ckptctl.manifest.json"


# --------------------------------------------------------------------------------------------
# clean checkpoints


def llama_config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
        "hidden_act": "silu", "initializer_range": 0.02, "mlp_bias": False, "pretraining_tp": 1,
        "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "transformers_version": "5.24.0", **LLAMA,
    }
    cfg.update(overrides)
    return cfg


def llama_tensors(cfg: dict[str, Any] | None = None, *, seed: int = 0, tie: bool | None = None
                  ) -> list[dict[str, np.ndarray]]:
    """The tensors of a tiny Llama as three groups: [embed + layer 0, layers 1.., norm + lm_head]."""
    c = cfg or llama_config()
    rng = np.random.default_rng(seed)
    h, v, i_ = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def layer(n: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{n}."
        return {p + "input_layernorm.weight": np.ones(h, np.float32),
                p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                p + "mlp.gate_proj.weight": w(i_, h), p + "mlp.up_proj.weight": w(i_, h),
                p + "mlp.down_proj.weight": w(h, i_)}

    first = {"model.embed_tokens.weight": w(v, h), **layer(0)}
    middle: dict[str, np.ndarray] = {}
    for n in range(1, c["num_hidden_layers"]):
        middle.update(layer(n))
    last = {"model.norm.weight": np.ones(h, np.float32)}
    if not (c.get("tie_word_embeddings") if tie is None else tie):
        last["lm_head.weight"] = w(v, h)
    return [first, middle, last]


def write_checkpoint(d: Path, groups: list[dict[str, np.ndarray]], *, config: dict[str, Any] | None = None,
                     prefix: str = "model", metadata: dict[str, str] | None = None, index: bool | None = None
                     ) -> list[str]:
    """Write ``groups`` as shards (one group: a single file) plus index and config. Returns file names.

    ``prefix`` is the stem, with a variant after a dot (``model.fp16``): the index is then named
    as transformers' ``_add_variant`` names it, ``model.safetensors.index.fp16.json``."""
    from ckptctl.format.index import encode_index
    from ckptctl.format.names import index_name

    d.mkdir(parents=True, exist_ok=True)
    groups = [g for g in groups if g]
    meta = {"format": "pt"} if metadata is None else metadata
    n = len(groups)
    sharded = n > 1 if index is None else index
    names: list[str] = []
    weight_map: dict[str, str] = {}
    total = params = 0
    for i, g in enumerate(groups, 1):
        name = f"{prefix}-{i:05d}-of-{n:05d}.safetensors" if sharded else f"{prefix}.safetensors"
        save_file(g, str(d / name), metadata=meta or None)
        names.append(name)
        for k, a in g.items():
            weight_map[k] = name
            total += a.nbytes
            params += a.size
    if sharded:
        stem, _, variant = prefix.partition(".")
        (d / index_name(stem, "safetensors", variant=variant or None)).write_bytes(
            encode_index(weight_map, total, total_parameters=params))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return names


def write_tokenizer(d: Path, *, vocab: int = 64, added: tuple[str, ...] = ()) -> None:
    """tokenizer.json as the tokenizers library saves it: a BPE vocabulary of ``vocab`` tokens,
    then the ``added`` special tokens (ids ``vocab``, ``vocab + 1``, ...)."""
    from tokenizers import AddedToken, Tokenizer, models

    tok = Tokenizer(models.BPE({f"t{i}": i for i in range(vocab)}, []))
    tok.add_special_tokens([AddedToken(a, special=True) for a in added])
    tok.save(str(d / "tokenizer.json"))


def _extras(d: Path) -> None:
    """What save_pretrained of a model and its tokenizer leaves beside the weights."""
    (d / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    write_tokenizer(d)


def make_clean_sharded(d: Path, **config: Any) -> str | None:
    cfg = llama_config(**config)
    write_checkpoint(d, llama_tensors(cfg), config=cfg)
    _extras(d)
    return None


def make_clean_single(d: Path, **config: Any) -> str | None:
    cfg = llama_config(**config)
    groups = llama_tensors(cfg)
    write_checkpoint(d, [{k: v for g in groups for k, v in g.items()}], config=cfg)
    _extras(d)
    return None


def shard(i: int, n: int = 3) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def read_index(d: Path) -> dict[str, Any]:
    return json.loads((d / ST_INDEX).read_text())


def write_index(d: Path, doc: dict[str, Any]) -> None:
    (d / ST_INDEX).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


_DROP = object()


def st_file(entries: list[tuple[str, str, list[int], bytes]], metadata: dict[str, str] | None = None, *,
            pad: bytes = b" ", align: int = 8) -> tuple[bytes, bytes]:
    """(header JSON incl. padding, data) of a safetensors file laid out in the given order."""
    obj: dict[str, Any] = {}
    if metadata is not None:
        obj["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, data in entries:
        obj[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    text = json.dumps(obj, separators=(",", ":")).encode()
    text += pad * ((-len(text)) % align)
    return text, b"".join(e[3] for e in entries)


def write_raw(path: Path, header: bytes, data: bytes = b"", *, length: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def _f32(*values: float) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _raw_model(d: Path, header_text: bytes, data: bytes = b"", **kw: Any) -> None:
    """A directory whose only file is a hand-made model.safetensors (no config: header cases)."""
    write_raw(d / "model.safetensors", header_text, data, **kw)


def _simple(extra: dict[str, Any] | None = None) -> tuple[list[tuple[str, str, list[int], bytes]], dict]:
    return [("a.weight", "F32", [2, 2], _f32(1, 2, 3, 4)), ("b.weight", "F32", [2], _f32(5, 6))], {"format": "pt"}


# --------------------------------------------------------------------------------------------
# header level (one model.safetensors, every rule of the format layer)


def make_truncated_shard(d: Path) -> str:
    make_clean_sharded(d)
    p = d / shard(2)
    p.write_bytes(p.read_bytes()[:-100])
    return "header.truncated"


def make_trailing_bytes(d: Path) -> str:
    make_clean_single(d)
    with open(d / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    return "header.trailing_bytes"


def make_lfs_pointer(d: Path) -> str:
    make_clean_sharded(d)
    size = (d / shard(2)).stat().st_size
    (d / shard(2)).write_text("version https://git-lfs.github.com/spec/v1\n"
                              "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
                              f"size {size}\n")
    return "header.lfs_pointer"


def make_html_page(d: Path) -> str:
    make_clean_sharded(d)
    (d / shard(3)).write_text("<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>...</body></html>\n")
    return "header.html_page"


def make_empty_shard(d: Path) -> str:
    make_clean_sharded(d)
    (d / shard(2)).write_bytes(b"")
    return "header.too_small"


def make_header_too_large(d: Path) -> str:
    _raw_model(d, b"{}      ", length=200_000_000)
    return "header.too_large"


def make_header_length_exceeds_file(d: Path) -> str:
    h, data = st_file(*_simple())
    _raw_model(d, h, data, length=len(h) + len(data) + 8)
    return "header.length_exceeds_file"


def make_header_not_utf8(d: Path) -> str:
    h, data = st_file(*_simple())
    _raw_model(d, h.replace(b"a.weight", b"a.w\xffght"), data)
    return "header.not_utf8"


def make_header_bad_json(d: Path) -> str:
    h, data = st_file(*_simple())
    _raw_model(d, h.replace(b'"dtype"', b"'dtype'", 1), data)
    return "header.bad_json"


def make_header_not_object(d: Path) -> str:
    _raw_model(d, b"[1,2,3] ")
    return "header.not_object"


def make_header_duplicate_key(d: Path) -> str:
    text = (b'{"__metadata__":{"format":"pt"},"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}')
    _raw_model(d, text + b" " * ((-len(text)) % 8), _f32(1, 2))
    return "header.duplicate_key"


def make_header_nul_padding(d: Path) -> str:
    entries, meta = _simple()
    h, data = st_file(entries, meta, pad=b"\0", align=16)
    if not h.endswith(b"\0"):
        h += b"\0" * 8
    _raw_model(d, h, data)
    return "header.bad_padding"


def make_header_whitespace_padding(d: Path) -> str:
    entries, meta = _simple()
    h, data = st_file(entries, meta)
    _raw_model(d, h + b"\n" + b" " * 7, data)
    return "header.whitespace_padding"


def make_header_leading_whitespace(d: Path) -> str:
    entries, meta = _simple()
    h, data = st_file(entries, meta)
    h = b" " * 8 + h
    _raw_model(d, h, data)
    return "header.leading_whitespace"


def make_metadata_tensor(d: Path) -> str:
    h, data = st_file([("__metadata__", "F32", [1], _f32(1))])
    _raw_model(d, h, data)
    return "header.metadata_tensor"


def make_bad_metadata(d: Path) -> str:
    entries, _ = _simple()
    h, data = st_file(entries, {"format": "pt", "step": 5})  # type: ignore[dict-item]
    _raw_model(d, h, data)
    return "header.bad_metadata"


def make_format_missing(d: Path) -> str:
    entries, _ = _simple()
    h, data = st_file(entries, {"step": "5"})
    _raw_model(d, h, data)
    return "header.format_missing"


def make_format_unknown(d: Path) -> str:
    entries, _ = _simple()
    h, data = st_file(entries, {"format": "np"})
    _raw_model(d, h, data)
    return "header.format_unknown"


def _entry_edit(d: Path, edit: Callable[[dict[str, Any]], None], data: bytes | None = None) -> None:
    entries, meta = _simple()
    h, raw = st_file(entries, meta)
    obj = json.loads(h)
    edit(obj)
    text = json.dumps(obj, separators=(",", ":")).encode()
    _raw_model(d, text + b" " * ((-len(text)) % 8), raw if data is None else data)


def make_extra_field(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].update(foo=1))
    return "header.extra_field"


def make_bad_entry(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].pop("shape"))
    return "header.bad_entry"


def make_unknown_dtype(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].update(dtype="F128"))
    return "header.unknown_dtype"


def make_bad_shape(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].update(shape="2x2"))
    return "header.bad_shape"


def make_negative_shape(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].update(shape=[-2, -2]))
    return "header.negative_shape"


def make_bad_offsets(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].update(data_offsets=[16, 0]))
    return "header.bad_offsets"


def make_overflow(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].update(shape=[1 << 30, 1 << 30]))
    return "header.overflow"


def make_misaligned_slice(d: Path) -> str:
    h, data = st_file([("q.weight", "F4", [3], b"\x11\x01")], {"format": "pt"})
    _raw_model(d, h, data)
    return "header.misaligned_slice"


def make_size_mismatch(d: Path) -> str:
    _entry_edit(d, lambda o: o["a.weight"].update(shape=[3, 2]))
    return "header.size_mismatch"


def make_offset_hole(d: Path) -> str:
    def edit(o: dict[str, Any]) -> None:
        o["b.weight"]["data_offsets"] = [20, 28]
    _entry_edit(d, edit, _f32(1, 2, 3, 4) + b"\0" * 4 + _f32(5, 6))
    return "header.offset_hole"


def make_offset_overlap(d: Path) -> str:
    def edit(o: dict[str, Any]) -> None:
        o["b.weight"]["data_offsets"] = [12, 20]
    _entry_edit(d, edit, _f32(1, 2, 3, 4, 5))
    return "header.offset_overlap"


def make_unaligned_tensor(d: Path) -> str:
    h, data = st_file([("m.mask", "U8", [3], b"\1\1\1"), ("a.weight", "F32", [2], _f32(1, 2))],
                      {"format": "pt"})
    _raw_model(d, h, data)
    return "header.unaligned_tensor"


def make_unaligned_header(d: Path) -> str:
    entries, meta = _simple()
    h, data = st_file(entries, meta, align=1)
    if len(h) % 8 == 0:
        h += b" "
    _raw_model(d, h, data)
    return "header.unaligned_header"


def make_hub_limit(d: Path) -> str:
    entries, _ = _simple()
    h, data = st_file(entries, {"format": "pt", "notes": "x" * 25_000_000})
    _raw_model(d, h, data)
    return "header.hub_limit"


def make_f6_dtype(d: Path) -> str:
    h, data = st_file([("q.weight", "F6_E2M3", [4], b"\x01\x02\x03")], {"format": "pt"})
    _raw_model(d, h, data)
    return "header.dtype_not_torch"


# --------------------------------------------------------------------------------------------
# directory and index level


def make_dtype_min_version(d: Path) -> str:
    h, data = st_file([("a.weight", "F32", [2], _f32(1, 2)), ("a.scale", "F8_E8M0", [2], b"\x7f\x80")],
                      {"format": "pt"})
    _raw_model(d, h, data)
    return "header.dtype_min_version"


def make_stale_index_beside_single(d: Path) -> str:
    make_clean_single(d)
    tmp = d.parent / (d.name + ".sharded")
    make_clean_sharded(tmp)
    shutil.copy(tmp / ST_INDEX, d / ST_INDEX)  # the index of an earlier sharded save, its shards gone
    shutil.rmtree(tmp)
    return "layout.index_and_single"


def make_unreferenced_shard(d: Path) -> str:
    make_clean_sharded(d)
    save_file({"old.weight": np.ones((2, 2), np.float32)}, str(d / "model-00004-of-00005.safetensors"),
              metadata={"format": "pt"})
    return "layout.unreferenced_shard"


def make_index_parent_path(d: Path) -> str:
    make_clean_sharded(d)
    outside = d.parent / (d.name + ".outside")
    outside.mkdir()
    shutil.move(str(d / shard(3)), str(outside / "x.safetensors"))
    idx = read_index(d)
    idx["weight_map"] = {k: (f"../{outside.name}/x.safetensors" if v == shard(3) else v)
                         for k, v in idx["weight_map"].items()}
    write_index(d, idx)
    return "layout.shard_missing"


def make_index_absolute_path(d: Path) -> str:
    make_clean_sharded(d)
    outside = d.parent / (d.name + ".outside")
    outside.mkdir()
    shutil.move(str(d / shard(3)), str(outside / "x.safetensors"))
    idx = read_index(d)
    idx["weight_map"] = {k: (str((outside / "x.safetensors").resolve()) if v == shard(3) else v)
                         for k, v in idx["weight_map"].items()}
    write_index(d, idx)
    return "layout.shard_missing"


def make_symlink_escape(d: Path) -> str:
    make_clean_sharded(d)
    outside = d.parent / (d.name + ".outside")
    outside.mkdir()
    shutil.move(str(d / shard(2)), str(outside / shard(2)))
    os.symlink(os.path.relpath(outside / shard(2), d), d / shard(2))
    return "dir.symlink_escape"


def make_config_symlink_escape(d: Path) -> str:
    """config.json is a link to a file outside: verify must report it without opening it."""
    make_clean_sharded(d)
    outside = d.parent / (d.name + ".outside")
    outside.mkdir()
    shutil.move(str(d / "config.json"), str(outside / "config.json"))
    os.symlink(os.path.relpath(outside / "config.json", d), d / "config.json")
    return "dir.symlink_escape"


def make_broken_link(d: Path) -> str:
    make_clean_sharded(d)
    (d / shard(2)).unlink()
    os.symlink("model-00002-of-00003.safetensors.gone", d / shard(2))
    return "dir.broken_link"


def make_shard_is_directory(d: Path) -> str:
    make_clean_sharded(d)
    (d / shard(2)).unlink()
    (d / shard(2)).mkdir()
    return "dir.not_a_file"


def make_index_is_fifo(d: Path) -> str:
    """Opening a FIFO blocks until a writer appears: verify must not open it (the test would hang)."""
    make_clean_sharded(d)
    (d / ST_INDEX).unlink()
    os.mkfifo(d / ST_INDEX)
    return "dir.not_a_file"


def make_duplicate_tensor(d: Path) -> str:
    make_clean_sharded(d)
    t = load_file(str(d / shard(1)))
    t["model.norm.weight"] = load_file(str(d / shard(3)))["model.norm.weight"]
    save_file(t, str(d / shard(1)), metadata={"format": "pt"})
    return "dir.duplicate_tensor"


def make_wrong_total_size(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["metadata"]["total_size"] += 4096
    write_index(d, idx)
    return "index.total_size_mismatch"


def make_total_size_missing(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    del idx["metadata"]["total_size"]
    write_index(d, idx)
    return "index.total_size_missing"


def make_total_parameters_mismatch(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["metadata"]["total_parameters"] = 333_000
    write_index(d, idx)
    return "index.total_parameters_mismatch"


def make_index_no_metadata(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    del idx["metadata"]
    write_index(d, idx)
    return "index.no_metadata"


def make_index_bad_json(d: Path) -> str:
    make_clean_sharded(d)
    (d / ST_INDEX).write_text(read_index(d).__repr__())
    return "index.bad_json"


def make_index_bad_schema(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["weight_map"] = list(idx["weight_map"])
    write_index(d, idx)
    return "index.bad_schema"


def make_index_duplicate_key(d: Path) -> str:
    make_clean_sharded(d)
    text = (d / ST_INDEX).read_text()
    (d / ST_INDEX).write_text(text.replace('"weight_map": {', '"weight_map": {\n    "lm_head.weight": '
                                          f'"{shard(1)}",', 1))
    return "index.duplicate_key"


def make_index_empty(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["weight_map"] = {}
    write_index(d, idx)
    return "index.empty"


def make_index_too_large(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["metadata"]["notes"] = "x" * (10 * 1024 * 1024)  # huggingface_hub refuses an index over 10 MiB
    write_index(d, idx)
    return "index.too_large"


def make_shard_too_large(d: Path) -> str:
    """Shards of about 4 KB checked with --max-shard-size 2KB (see ``ARGS``)."""
    make_clean_sharded(d)
    return "dir.shard_too_large"


def make_shard_missing(d: Path) -> str:
    make_clean_sharded(d)
    (d / shard(2)).unlink()
    return "layout.shard_missing"


def make_tensor_missing(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["weight_map"]["mtp.fc.weight"] = shard(3)  # hub #4725: the index names a tensor no shard holds
    write_index(d, idx)
    return "index.tensor_missing"


def make_tensor_not_indexed(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    del idx["weight_map"]["model.norm.weight"]
    write_index(d, idx)
    return "index.tensor_not_indexed"


def make_wrong_shard(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["weight_map"]["model.norm.weight"] = shard(1)
    write_index(d, idx)
    return "index.wrong_shard"


def make_shard_numbering(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    rename = {shard(i): shard(i, 4) for i in (1, 2, 3)}
    for old, new in rename.items():
        (d / old).rename(d / new)
    idx["weight_map"] = {k: rename[v] for k, v in idx["weight_map"].items()}
    write_index(d, idx)
    return "index.shard_numbering"


def make_nonstandard_shard_name(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    rename = {shard(i): f"part-{'abc'[i - 1]}.safetensors" for i in (1, 2, 3)}
    for old, new in rename.items():
        (d / old).rename(d / new)
    idx["weight_map"] = {k: rename[v] for k, v in idx["weight_map"].items()}
    write_index(d, idx)
    return "index.nonstandard_name"


def make_shard_extension(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    (d / shard(3)).rename(d / "model-00003-of-00003.bin")
    idx["weight_map"] = {k: ("model-00003-of-00003.bin" if v == shard(3) else v) for k, v in idx["weight_map"].items()}
    write_index(d, idx)
    return "index.shard_extension"


def make_missing_index(d: Path) -> str:
    make_clean_sharded(d)
    (d / ST_INDEX).unlink()
    return "layout.missing_index"


def make_alias_dangling(d: Path) -> str:
    make_clean_sharded(d)
    idx = read_index(d)
    idx["metadata"]["model.lm_head_alias.weight"] = "model.embed_tokens_old.weight"
    write_index(d, idx)
    return "metadata.alias_dangling"


def make_no_weights(d: Path) -> str:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(llama_config()))
    return "dir.no_weights"


def make_unrecognised_weights(d: Path) -> str:
    make_clean_sharded(d)
    save_file({"x": np.ones(2, np.float32)}, str(d / "consolidated.safetensors"), metadata={"format": "pt"})
    return "layout.unrecognised_weights"


def make_variant_incomplete(d: Path) -> str:
    make_clean_sharded(d)
    cfg = llama_config()
    write_checkpoint(d, llama_tensors(cfg, seed=1), prefix="model.fp16")
    (d / "model.fp16-00002-of-00003.safetensors").unlink()
    return "layout.shard_missing"


def _leftover(d: Path, make: Callable[[Path], Any]) -> None:
    make_clean_sharded(d)
    make(d)


def make_leftover_temp_shard(d: Path) -> str:
    _leftover(d, lambda d: shutil.copy(d / shard(1), d / "model-00001-of-?????.safetensors"))
    return "layout.leftover"


def make_leftover_staging_dir(d: Path) -> str:
    _leftover(d, lambda d: (d / "_tmp_step_100.0000018a3b2c4d5e-1a2b3c4d").mkdir())
    return "layout.leftover"


def make_leftover_st_tempfile(d: Path) -> str:
    _leftover(d, lambda d: shutil.copy(d / shard(2), d / ".tmpciTtek"))
    return "layout.leftover"


def make_leftover_incomplete(d: Path) -> str:
    _leftover(d, lambda d: (d / "model-00001-of-00003.safetensors.incomplete").write_bytes(b"\0" * 64))
    return "layout.leftover"


def make_leftover_lock(d: Path) -> str:
    _leftover(d, lambda d: (d / "model.safetensors.lock").write_bytes(b""))
    return "dir.lock_file"


# --------------------------------------------------------------------------------------------
# config.json agreement


def _with_config(d: Path, *, single: bool = False, **changes: Any) -> None:
    (make_clean_single if single else make_clean_sharded)(d)
    edit_config(d, **changes)


def make_untied_config_without_lm_head(d: Path) -> str:
    cfg = llama_config()
    write_checkpoint(d, llama_tensors(cfg, tie=True), config=cfg)  # tie_word_embeddings false, no lm_head
    return "config.lm_head_missing"


def make_tied_config_with_lm_head(d: Path) -> str:
    _with_config(d, tie_word_embeddings=True)  # lm_head.weight is stored
    return "config.lm_head_tied_present"


def make_wrong_vocab_rows(d: Path) -> str:
    _with_config(d, vocab_size=128)
    return "config.vocab_mismatch"


def make_wrong_hidden_size(d: Path) -> str:
    cfg = llama_config()
    groups = llama_tensors(cfg)
    groups[0]["model.embed_tokens.weight"] = np.ones((64, 12), np.float32)
    write_checkpoint(d, groups, config=cfg)
    return "config.hidden_mismatch"


def make_missing_layer(d: Path) -> str:
    cfg = llama_config(num_hidden_layers=3)
    groups = llama_tensors(cfg)
    groups[1] = {k: v for k, v in groups[1].items() if not k.startswith("model.layers.1.")}
    write_checkpoint(d, groups, config=cfg)
    return "config.layer_missing"


def make_extra_layer(d: Path) -> str:
    _with_config(d, num_hidden_layers=1)
    return "config.layer_extra"


def make_wrong_kv_heads(d: Path) -> str:
    _with_config(d, num_key_value_heads=4)
    return "config.kv_heads_mismatch"


def make_wrong_heads(d: Path) -> str:
    _with_config(d, num_attention_heads=8)
    return "config.attention_shape"


def make_wrong_intermediate_size(d: Path) -> str:
    _with_config(d, intermediate_size=48)
    return "config.mlp_shape"


# -- the model-class check (transformers builds LlamaForCausalLM on the meta device and its loader
# matches the keys); each breakage is one the static rules above do not see, except the shape

def make_class_missing(d: Path) -> str:
    """A norm the class needs is not stored: transformers initialises it (LOAD REPORT: MISSING)."""
    cfg = llama_config()
    groups = llama_tensors(cfg)
    del groups[0]["model.layers.0.post_attention_layernorm.weight"]
    write_checkpoint(d, groups, config=cfg)
    _extras(d)
    return "config.class_missing"


def make_class_shape(d: Path) -> str:
    """head_dim says 8, the projections were saved with 4: transformers raises (size mismatch)."""
    _with_config(d, head_dim=8)
    return "config.class_shape"


def make_class_disagrees(d: Path) -> str:
    """q/k/v biases stored but attention_bias is false: the class builds the projections without
    them and the loader drops the trained biases (LOAD REPORT: UNEXPECTED)."""
    cfg = llama_config()
    groups = llama_tensors(cfg)
    rng = np.random.default_rng(1)
    for i in range(cfg["num_hidden_layers"]):
        g = groups[0] if i == 0 else groups[1]
        for proj, rows in (("q", 16), ("k", 8), ("v", 8)):
            g[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(rows).astype(np.float32)
    write_checkpoint(d, groups, config=cfg)
    _extras(d)
    return "config.class_disagrees"


def make_class_unused(d: Path) -> str:
    """A classification head stored beside a causal-LM checkpoint: no place for it in
    LlamaForCausalLM, dropped on load (a warning: nothing the model uses is wrong)."""
    cfg = llama_config()
    groups = llama_tensors(cfg)
    groups[2]["score.weight"] = np.ones((2, cfg["hidden_size"]), np.float32)
    write_checkpoint(d, groups, config=cfg)
    _extras(d)
    return "config.class_unused"


def make_class_not_checked(d: Path) -> str:
    """An architecture that exists only as remote code: the class check does not run (a note)."""
    make_clean_sharded(d, architectures=["MyLlamaForCausalLM"], model_type="my_llama",
                       auto_map={"AutoConfig": "modeling_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyLlama"})
    return "config.class_not_checked"


def make_dtype_mismatch(d: Path) -> str:
    _with_config(d, dtype="bfloat16")
    return "config.dtype_mismatch"


def make_config_bad_json(d: Path) -> str:
    make_clean_sharded(d)
    (d / "config.json").write_text('{"model_type": "llama",')
    return "config.bad_json"


def make_config_missing_field(d: Path) -> str:
    _with_config(d, model_type=_DROP)
    return "config.missing_field"


def make_tokenizer_beyond_vocab(d: Path) -> str:
    make_clean_sharded(d)
    write_tokenizer(d, added=("<|im_start|>", "<|im_end|>"))  # ids 64 and 65; vocab_size is 64
    return "config.tokenizer_vocab"


def make_tokenizer_missing(d: Path) -> str:
    make_clean_sharded(d)
    (d / "tokenizer.json").unlink()
    return "config.tokenizer_missing"


def make_generation_config_missing(d: Path) -> str:
    make_clean_sharded(d)
    (d / "generation_config.json").unlink()
    return "config.generation_config_missing"


def make_config_missing(d: Path) -> str:
    make_clean_sharded(d)
    (d / "config.json").unlink()
    return "config.missing"


def make_config_names_not_recognised(d: Path) -> str:
    """A model whose tensor names no rule knows (a T5-style encoder): the shapes are not checked."""
    cfg = llama_config()  # every layer present: the generic layer-count rule has nothing to report
    write_checkpoint(d, [{f"encoder.block.{i}.layer.0.SelfAttention.q.weight": np.ones((16, 16), np.float32)
                          for i in range(cfg["num_hidden_layers"])}], config=cfg)
    return "config.not_checked"


def make_quantization_missing(d: Path) -> str:
    cfg = llama_config()
    groups = llama_tensors(cfg)
    groups[2]["model.layers.0.mlp.down_proj.weight_scale"] = np.ones(1, np.float32)
    write_checkpoint(d, groups, config=cfg)
    return "config.quantization_missing"


def make_quantization_unused(d: Path) -> str:
    _with_config(d, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    return "config.quantization_unused"


def make_transformers_weights_missing(d: Path) -> str:
    _with_config(d, transformers_weights="consolidated.safetensors")
    return "config.weights_file_missing"


def make_transformers_weights_outside(d: Path) -> str:
    _with_config(d, transformers_weights="../other/model.safetensors")
    return "config.weights_file_outside"


def gpt2_tensors(*, n_positions: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, v = 16, 64

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    out = {"transformer.wte.weight": w(v, h), "transformer.wpe.weight": w(n_positions, h),
           "transformer.ln_f.weight": np.ones(h, np.float32), "transformer.ln_f.bias": np.zeros(h, np.float32)}
    for i in range(2):
        p = f"transformer.h.{i}."
        out.update({p + "ln_1.weight": np.ones(h, np.float32), p + "ln_1.bias": np.zeros(h, np.float32),
                    p + "attn.c_attn.weight": w(h, 3 * h), p + "attn.c_attn.bias": w(3 * h),
                    p + "attn.c_proj.weight": w(h, h), p + "attn.c_proj.bias": w(h),
                    p + "ln_2.weight": np.ones(h, np.float32), p + "ln_2.bias": np.zeros(h, np.float32),
                    p + "mlp.c_fc.weight": w(h, 4 * h), p + "mlp.c_fc.bias": w(4 * h),
                    p + "mlp.c_proj.weight": w(4 * h, h), p + "mlp.c_proj.bias": w(h)})
    return out


def gpt2_config(**overrides: Any) -> dict[str, Any]:
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64, "n_embd": 16, "n_head": 4,
           "n_layer": 2, "n_positions": 32, "n_inner": None, "tie_word_embeddings": True, "dtype": "float32"}
    cfg.update(overrides)
    return cfg


def make_wrong_positions(d: Path) -> str:
    write_checkpoint(d, [gpt2_tensors()], config=gpt2_config(n_positions=24))
    return "config.position_mismatch"


# --------------------------------------------------------------------------------------------
# PEFT adapters (peft's file format, written without peft)


def adapter_config(base: Path | str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": ["v_proj", "q_proj"], "base_model_name_or_path": str(base), "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False, "use_rslora": False,
        "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None, "revision": None,
    }
    cfg.update(overrides)
    return cfg


def lora_tensors(modules: dict[str, tuple[int, int]], ranks: dict[str, int] | int = 4, *, seed: int = 0
                 ) -> dict[str, np.ndarray]:
    """peft's saved keys for Linear modules {module path: (out, in)}."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for mod, (o, i) in modules.items():
        r = ranks if isinstance(ranks, int) else ranks[mod]
        out[f"base_model.model.{mod}.lora_A.weight"] = (rng.standard_normal((r, i)) * 0.02).astype(np.float32)
        out[f"base_model.model.{mod}.lora_B.weight"] = (rng.standard_normal((o, r)) * 0.02).astype(np.float32)
    return out


def llama_lora_modules(targets: tuple[str, ...] = ("q_proj", "v_proj"), layers: int = 2) -> dict[str, tuple[int, int]]:
    q = LLAMA["num_attention_heads"] * LLAMA["head_dim"]
    kv = LLAMA["num_key_value_heads"] * LLAMA["head_dim"]
    shapes = {"q_proj": (q, LLAMA["hidden_size"]), "k_proj": (kv, LLAMA["hidden_size"]),
              "v_proj": (kv, LLAMA["hidden_size"]), "o_proj": (LLAMA["hidden_size"], q)}
    return {f"model.layers.{n}.self_attn.{t}": shapes[t] for n in range(layers) for t in targets}


def write_adapter(d: Path, tensors: dict[str, np.ndarray], config: dict[str, Any] | None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (d / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def base_for(d: Path) -> Path:
    """The base model an adapter builder uses: a clean tiny Llama beside ``d``."""
    base = d.parent / (d.name + ".base")
    if not base.exists():
        make_clean_single(base)
    return base.resolve()


def make_clean_adapter(d: Path) -> str | None:
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d)))
    return None


def make_adapter_wrong_rank(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d), r=8))
    return "adapter.rank_mismatch"


def make_adapter_untargeted_key(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d), target_modules=["q_proj"]))
    return "adapter.untargeted_key"


def make_adapter_pair_missing(d: Path) -> str:
    t = lora_tensors(llama_lora_modules())
    del t["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    write_adapter(d, t, adapter_config(base_for(d)))
    return "adapter.pair_missing"


def make_adapter_bad_prefix(d: Path) -> str:
    t = {k.removeprefix("base_model.model."): v for k, v in lora_tensors(llama_lora_modules()).items()}
    write_adapter(d, t, adapter_config(base_for(d)))
    return "adapter.bad_prefix"


def make_adapter_name_in_key(d: Path) -> str:
    t = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
         for k, v in lora_tensors(llama_lora_modules()).items()}
    write_adapter(d, t, adapter_config(base_for(d)))
    return "adapter.adapter_name_in_key"


def make_adapter_dora_without_magnitude(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d), use_dora=True))
    return "adapter.dora_magnitude_missing"


def make_adapter_missing_keys(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()),
                  adapter_config(base_for(d), target_modules=["q_proj", "k_proj", "v_proj"]))
    return "adapter.missing_keys"


def make_adapter_shape_mismatch(d: Path) -> str:
    mods = llama_lora_modules()
    mods["model.layers.0.self_attn.q_proj"] = (16, 24)  # trained on a model with hidden_size 24
    write_adapter(d, lora_tensors(mods), adapter_config(base_for(d)))
    return "adapter.shape_mismatch"


def make_adapter_module_not_in_base(d: Path) -> str:
    mods = llama_lora_modules(layers=3)  # the base has 2 layers
    write_adapter(d, lora_tensors(mods), adapter_config(base_for(d)))
    return "adapter.module_not_in_base"


def make_adapter_unexpected_key(d: Path) -> str:
    t = lora_tensors(llama_lora_modules())
    t["base_model.model.score.weight"] = np.ones((2, 16), np.float32)
    write_adapter(d, t, adapter_config(base_for(d)))
    return "adapter.unexpected_key"


def make_adapter_bad_config(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()), None)
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4,,}')
    return "adapter.bad_config"


def make_adapter_missing_r(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d), r=None))
    return "adapter.missing_field"


def make_adapter_without_config(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()), None)
    return "layout.adapter_without_config"


# --------------------------------------------------------------------------------------------
# manifest (the format `export --manifest` writes)


def make_adapter_empty(d: Path) -> str:
    write_adapter(d, {}, adapter_config(base_for(d)))
    return "adapter.empty"


def make_adapter_not_lora(d: Path) -> str:
    t = {f"base_model.model.{m}.ia3_l": np.ones((s[0], 1), np.float32) for m, s in llama_lora_modules().items()}
    write_adapter(d, t, adapter_config(base_for(d), peft_type="IA3", feedforward_modules=[]))
    return "adapter.not_checked"


def make_adapter_base_unavailable(d: Path) -> str:
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config("nobody/not-downloaded"))
    return "adapter.base_unavailable"


def make_adapter_missing_optional(d: Path) -> str:
    """lora_alpha left out: peft falls back to its default (a warning; ``null`` is the error case)."""
    cfg = adapter_config(base_for(d))
    del cfg["lora_alpha"]
    write_adapter(d, lora_tensors(llama_lora_modules()), cfg)
    return "adapter.missing_optional"


def make_adapter_regex_not_checked(d: Path) -> str:
    """A target_modules pattern that backtracks exponentially on a non-matching name."""
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d), target_modules=r"(\w+\.?\w*)+X"))
    return "adapter.regex_not_checked"


def make_adapter_beside_model(d: Path) -> str:
    make_clean_sharded(d)
    write_adapter(d, lora_tensors(llama_lora_modules()), adapter_config(base_for(d)))
    return "layout.adapter_beside_model"


def make_two_adapters(d: Path) -> str:
    import torch

    make_clean_adapter(d)
    torch.save({k: torch.from_numpy(v) for k, v in lora_tensors(llama_lora_modules()).items()},
               d / "adapter_model.bin")
    return "layout.two_adapters"


def write_manifest(d: Path) -> None:
    from ckptctl.manifest import build_manifest, encode_manifest

    files = sorted(n for n in os.listdir(d) if n != MANIFEST)
    (d / MANIFEST).write_bytes(encode_manifest(build_manifest(d, files, label="corpus")))


def make_clean_with_manifest(d: Path) -> str | None:
    make_clean_sharded(d)
    write_manifest(d)
    return None


def make_manifest_size_mismatch(d: Path) -> str:
    make_clean_with_manifest(d)
    with open(d / "config.json", "a") as f:
        f.write("\n")
    return "manifest.size_mismatch"


def make_manifest_hash_mismatch(d: Path) -> str:
    """Same size, one flipped byte inside tensor data: only --deep can see it."""
    make_clean_with_manifest(d)
    p = d / shard(2)
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x01
    p.write_bytes(bytes(raw))
    return "manifest.hash_mismatch"


def make_manifest_file_missing(d: Path) -> str:
    make_clean_with_manifest(d)
    (d / "generation_config.json").unlink()
    return "manifest.file_missing"


def make_manifest_unlisted_file(d: Path) -> str:
    make_clean_with_manifest(d)
    doc = json.loads((d / MANIFEST).read_text())
    del doc["files"][ST_INDEX]  # an index added after the export
    (d / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return "manifest.unlisted_file"


def make_manifest_bad_json(d: Path) -> str:
    make_clean_sharded(d)
    (d / MANIFEST).write_text('{"schema_version": 1, "files": ')
    return "manifest.bad_json"


# --------------------------------------------------------------------------------------------
# --deep


def make_manifest_bad_schema(d: Path) -> str:
    make_clean_with_manifest(d)
    doc = json.loads((d / MANIFEST).read_text())
    doc["files"] = sorted(doc["files"])  # a list of names, no sizes or digests
    (d / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return "manifest.bad_schema"


def make_manifest_path_outside(d: Path) -> str:
    make_clean_with_manifest(d)
    outside = d.parent / (d.name + ".outside")
    outside.mkdir()
    (outside / "notes.txt").write_text("not part of the checkpoint\n")
    doc = json.loads((d / MANIFEST).read_text())
    doc["files"][f"../{outside.name}/notes.txt"] = {"size": 27, "sha256": "0" * 64}
    (d / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return "manifest.path_outside"


def _deep_single(d: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    cfg = llama_config()
    flat = {k: v for g in llama_tensors(cfg) for k, v in g.items()}
    edit(flat)
    write_checkpoint(d, [flat], config=cfg)


def make_deep_nan(d: Path) -> str:
    _deep_single(d, lambda t: t["model.layers.1.mlp.up_proj.weight"].__setitem__((3, 5), np.nan))
    return "deep.nan"


def make_deep_inf(d: Path) -> str:
    _deep_single(d, lambda t: t["model.layers.0.self_attn.o_proj.weight"].__setitem__((0, 0), -np.inf))
    return "deep.inf"


def make_deep_all_zero(d: Path) -> str:
    _deep_single(d, lambda t: t["model.layers.1.mlp.down_proj.weight"].fill(0.0))
    return "deep.all_zero"


# --------------------------------------------------------------------------------------------
# PyTorch pickles (need torch)


def make_deep_all_zero_vector(d: Path) -> str:
    _deep_single(d, lambda t: t["model.norm.weight"].fill(0.0))
    return "deep.all_zero_vector"


def make_deep_not_decoded(d: Path) -> str:
    """F8_E8M0 (a scale format without a zero) is hashed but not decoded."""
    h, data = st_file([("a.weight", "F32", [2], _f32(1, 2)), ("a.scale", "F8_E8M0", [2], b"\x7f\x80")],
                      {"format": "pt"})
    _raw_model(d, h, data)
    return "deep.not_decoded"


def torch_state(seed: int = 0) -> dict[str, Any]:
    import torch

    cfg = llama_config()
    return {k: torch.from_numpy(v.copy()) for g in llama_tensors(cfg, seed=seed) for k, v in g.items()}


def pickle_marker(d: Path) -> Path:
    """The file the malicious pickle of ``make_bin_unsafe_pickle`` would create if it ran."""
    return d.parent / (d.name + ".pwned")


class _Payload:
    """Unpickling this runs ``exec`` and creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def make_clean_bin(d: Path) -> str | None:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    torch.save(torch_state(), d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(llama_config(), indent=2))
    return None


def make_bin_unsafe_pickle(d: Path) -> str:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    sd = torch_state()
    sd["model.norm.weight"] = _Payload(pickle_marker(d))  # type: ignore[assignment]
    torch.save(sd, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(llama_config(), indent=2))
    return "pickle.unsafe_global"


def _rewrite_zip(path: Path, edit: Callable[[str, bytes], bytes | None]) -> None:
    with zipfile.ZipFile(path) as zf:
        items = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
    tmp = path.with_suffix(".rewrite")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as out:
        for name, data in items:
            new = edit(name, data)
            if new is not None:
                out.writestr(name, new)
    tmp.replace(path)


def make_bin_storage_truncated(d: Path) -> str:
    make_clean_bin(d)
    _rewrite_zip(d / "pytorch_model.bin", lambda n, b: b[: len(b) // 2] if n.endswith("/data/0") else b)
    return "pickle.storage_truncated"


def make_bin_storage_missing(d: Path) -> str:
    make_clean_bin(d)
    _rewrite_zip(d / "pytorch_model.bin", lambda n, b: None if n.endswith("/data/1") else b)
    return "pickle.storage_missing"


def make_bin_legacy_format(d: Path) -> str:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    torch.save(torch_state(), d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    (d / "config.json").write_text(json.dumps(llama_config(), indent=2))
    return "pickle.legacy_format"


def make_bin_legacy_unsafe_pickle(d: Path) -> str:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    sd = torch_state()
    sd["model.norm.weight"] = _Payload(pickle_marker(d))  # type: ignore[assignment]
    torch.save(sd, d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    return "pickle.unsafe_global"


def make_bin_lfs_pointer(d: Path) -> str:
    make_clean_bin(d)
    (d / "pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    return "pickle.lfs_pointer"


def make_bin_not_a_pickle(d: Path) -> str:
    make_clean_bin(d)
    (d / "pytorch_model.bin").write_bytes(bytes(range(256)) * 4)
    return "pickle.unreadable"


def make_bin_bad_archive(d: Path) -> str:
    make_clean_bin(d)
    _rewrite_zip(d / "pytorch_model.bin", lambda n, b: None if n.endswith("data.pkl") else b)
    return "pickle.bad_archive"


def make_bin_html_page(d: Path) -> str:
    make_clean_bin(d)
    (d / "pytorch_model.bin").write_text("<!DOCTYPE html>\n<html><head><title>Sign in</title></head></html>\n")
    return "pickle.html_page"


def make_bin_not_state_dict(d: Path) -> str:
    """A training checkpoint (state dict under "model", plus a step) where a state dict belongs."""
    import torch

    d.mkdir(parents=True, exist_ok=True)
    torch.save({"model": torch_state(), "step": 7}, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(llama_config(), indent=2))
    return "pickle.not_state_dict"


def make_bin_tensor_out_of_range(d: Path) -> str:
    """A tensor whose shape reaches past its (intact) storage: torch.load refuses to resize it."""
    import torch

    d.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.zeros(4), "b": torch.ones(2)}, d / "pytorch_model.bin")
    size4, size8 = b"QK\x00K\x04\x85", b"QK\x00K\x08\x85"  # BINPERSID, offset 0, shape (4,) -> (8,)

    def edit(name: str, data: bytes) -> bytes:
        if name.endswith("data.pkl"):
            assert data.count(size4) == 1, "torch.save's pickle changed"
            return data.replace(size4, size8)
        return data
    _rewrite_zip(d / "pytorch_model.bin", edit)
    return "pickle.tensor_out_of_range"


def make_bin_index_shard_missing(d: Path) -> str:
    import torch

    from ckptctl.format.index import encode_index

    d.mkdir(parents=True, exist_ok=True)
    sd = torch_state()
    keys = sorted(sd)
    half = {k: sd[k] for k in keys[: len(keys) // 2]}
    torch.save(half, d / "pytorch_model-00001-of-00002.bin")
    wm = {k: ("pytorch_model-00001-of-00002.bin" if k in half else "pytorch_model-00002-of-00002.bin") for k in keys}
    (d / "pytorch_model.bin.index.json").write_bytes(encode_index(wm, 1))
    return "layout.shard_missing"


def make_two_families(d: Path) -> str:
    import torch

    make_clean_single(d)
    state = torch_state()
    state.pop(sorted(state)[-1])  # other tensors: a second model (the same ones are layout.converted_pickle)
    torch.save(state, d / "pytorch_model.bin")
    return "layout.two_families"


# --------------------------------------------------------------------------------------------
# torch DCP (need torch)


def make_clean_dcp(d: Path) -> str | None:
    import warnings

    import torch.distributed.checkpoint as dcp

    d.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": torch_state(), "step": 7}, checkpoint_id=str(d))
    return None


def _distcp(d: Path) -> Path:
    return sorted(d.glob("*.distcp"))[0]


def make_dcp_file_missing(d: Path) -> str:
    make_clean_dcp(d)
    _distcp(d).unlink()
    return "dcp.file_missing"


def make_dcp_file_truncated(d: Path) -> str:
    make_clean_dcp(d)
    p = _distcp(d)
    p.write_bytes(p.read_bytes()[:-200])
    return "dcp.file_truncated"


def make_dcp_bad_metadata(d: Path) -> str:
    make_clean_dcp(d)
    (d / ".metadata").write_bytes(b"\x80\x04\x95garbage")
    return "dcp.bad_metadata"


def make_dcp_unsafe_global(d: Path) -> str:
    import pickle

    make_clean_dcp(d)
    (d / ".metadata").write_bytes(pickle.dumps(_Payload(pickle_marker(d))))
    return "dcp.unsafe_global"


def make_dcp_unreferenced_file(d: Path) -> str:
    make_clean_dcp(d)
    shutil.copy(_distcp(d), d / "__7_0.distcp")
    return "dcp.unreferenced_file"


def make_dcp_without_metadata(d: Path) -> str:
    make_clean_dcp(d)
    (d / ".metadata").unlink()
    return "layout.dcp_without_metadata"


def _edit_dcp_metadata(d: Path, edit: Callable[[Any], None]) -> None:
    """Rewrite .metadata (our own, trusted pickle) after ``edit`` changed the Metadata object."""
    import pickle

    md = pickle.loads((d / ".metadata").read_bytes())
    edit(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def make_dcp_path_outside(d: Path) -> str:
    import dataclasses

    make_clean_dcp(d)

    def edit(md: Any) -> None:
        key = sorted(md.storage_data, key=str)[0]
        md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="../elsewhere.distcp")
    _edit_dcp_metadata(d, edit)
    return "dcp.path_outside"


def make_dcp_chunk_missing(d: Path) -> str:
    make_clean_dcp(d)
    _edit_dcp_metadata(d, lambda md: md.storage_data.pop(sorted(md.storage_data, key=str)[0]))
    return "dcp.chunk_missing"


# --------------------------------------------------------------------------------------------
# multi-component roots (diffusers' model_index.json)


def make_clean_pipeline(d: Path) -> str | None:
    """A diffusers pipeline root: model_index.json, a transformers text encoder (the corpus
    Llama), a scheduler folder without weights."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "model_index.json").write_text(json.dumps({
        "_class_name": "DiffusionPipeline", "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", "LlamaForCausalLM"], "scheduler": ["diffusers", "DDPMScheduler"],
        "safety_checker": [None, None]}, indent=2, sort_keys=True) + "\n")
    make_clean_single(d / "text_encoder")
    (d / "scheduler").mkdir()
    (d / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "DDPMScheduler", '
                                                          '"num_train_timesteps": 10}\n')
    return None


def make_pipeline_component_missing(d: Path) -> str:
    make_clean_pipeline(d)
    shutil.rmtree(d / "text_encoder")
    return "layout.component_missing"


def make_pipeline_bad_model_index(d: Path) -> str:
    make_clean_pipeline(d)
    (d / "model_index.json").write_text('{"text_encoder": ["transformers", ')
    return "layout.bad_component_manifest"


def make_pipeline_component_without_weights(d: Path) -> str:
    make_clean_pipeline(d)
    (d / "text_encoder" / "model.safetensors").unlink()
    return "dir.no_weights"


def make_pipeline_component_truncated(d: Path) -> str:
    make_clean_pipeline(d)
    p = d / "text_encoder" / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    return "header.truncated"


# --------------------------------------------------------------------------------------------
# registry


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Path], str]
    args: tuple[str, ...] = ()  # verify options the case needs

    def __str__(self) -> str:
        return self.name

    @property
    def deep(self) -> bool:
        return "--deep" in self.args


# the static config rules are the fallback where the model-class check cannot run: their builders
# run with --static (the class check reports the same breakages under its own codes, below)
STATIC_RULES = ("make_untied_config_without_lm_head", "make_wrong_vocab_rows", "make_wrong_hidden_size",
                "make_missing_layer", "make_extra_layer", "make_wrong_kv_heads", "make_wrong_heads",
                "make_wrong_intermediate_size", "make_wrong_positions", "make_config_names_not_recognised")
ARGS = {
    **{name: ("--static",) for name in STATIC_RULES},
    "make_manifest_hash_mismatch": ("--deep",), "make_deep_nan": ("--deep",), "make_deep_inf": ("--deep",),
    "make_deep_all_zero": ("--deep",), "make_deep_all_zero_vector": ("--deep",), "make_deep_not_decoded": ("--deep",),
    "make_shard_too_large": ("--max-shard-size", "2KB"),
}


def make_dcp_metadata_not_a_map(d: Path) -> str:
    """Allow-listed classes only, but state_dict_metadata is a list: not DCP Metadata."""
    make_clean_dcp(d)

    def edit(md: Any) -> None:
        md.state_dict_metadata = sorted(md.state_dict_metadata)
    _edit_dcp_metadata(d, edit)
    return "dcp.bad_metadata"


def _cases() -> list[Case]:
    out: list[Case] = []
    for name, fn in sorted(globals().items()):
        if not name.startswith("make_") or name.startswith("make_clean") or not callable(fn):
            continue
        out.append(Case(name.removeprefix("make_"), fn, ARGS.get(name, ())))
    return out


CASES: list[Case] = _cases()
CLEAN: dict[str, Callable[[Path], str | None]] = {
    "sharded": make_clean_sharded, "single": make_clean_single, "adapter": make_clean_adapter,
    "manifest": make_clean_with_manifest, "bin": make_clean_bin, "dcp": make_clean_dcp,
    "pipeline": make_clean_pipeline,
}
