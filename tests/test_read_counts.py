"""One reading per command, counted (issue 47): on a checkpoint of many shards, every command
parses its index once and decodes each shard's header once, whatever steps it runs (verify's
consistency checks and model-class check, a repair's analysis, its no-op test and the verify of
its staged version, inspect, export). A count, not a time: a second decoding of the same bytes
fails here, on any machine.

Every decoding goes through ``ckptctl.format.header._parse_into`` (the typed decoder, else the
strict reader) and every index parse through ``ckptctl.format.index.parse_index``; both are
wrapped to record what they decoded, by the SHA-256 of the bytes (the same bytes under two names,
as a repair's staged version hard-links the shards it keeps, are one reading)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import ckptctl.format.header as H
import ckptctl.format.index as I
import ckptctl.layout.reading as R
from ckptctl.fastpaths import FAST_PATHS
from ckptctl.format.index import encode_index
from tests.support import invoke

LAYERS = 16  # one shard per layer, plus one for the embeddings and the head
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          "torch_dtype": "float32"}


def _llama(d: Path) -> list[str]:
    """A Llama of LAYERS layers in LAYERS + 1 shards with its index and config; the shard names."""
    d.mkdir()
    rng = np.random.default_rng(0)
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    groups: list[dict[str, tuple[int, ...]]] = []
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        groups.append({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h, h),
                       p + "self_attn.v_proj.weight": (h, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    groups.append({"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)})
    names, wm, total = [], {}, 0
    for k, group in enumerate(groups, 1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        tensors = {t: (rng.standard_normal(shape) * 0.02).astype(np.float32) for t, shape in group.items()}
        save_file(tensors, str(d / name), metadata={"format": "pt"})
        wm.update(dict.fromkeys(tensors, name))
        total += sum(a.nbytes for a in tensors.values())
        names.append(name)
    (d / "model.safetensors.index.json").write_bytes(encode_index(wm, total))
    (d / "config.json").write_text(json.dumps(CONFIG))
    return names


class Readings:
    """What was decoded while counting: (what, digest of the bytes) -> times, and the paths."""

    def __init__(self) -> None:
        self.times: Counter[tuple[str, str]] = Counter()
        self.paths: dict[tuple[str, str], set[str]] = {}

    def note(self, what: str, data: Any, path: str) -> None:
        key = (what, hashlib.sha256(bytes(data)).hexdigest())
        self.times[key] += 1
        self.paths.setdefault(key, set()).add(path)

    def count(self, what: str) -> int:
        return sum(n for (w, _), n in self.times.items() if w == what)

    def again(self) -> list[tuple[str, int, list[str]]]:
        """Each content decoded more than once: (what, times, the paths it was read at)."""
        return [(w, n, sorted(self.paths[w, k])) for (w, k), n in self.times.items() if n > 1]


@pytest.fixture
def readings(monkeypatch: pytest.MonkeyPatch) -> Readings:
    seen = Readings()
    parse_into, parse_index = H._parse_into, I.parse_index

    def counted_parse_into(hdr: Any, raw: bytearray, fast: bool, keep: bool = False) -> None:
        seen.note("header", raw, hdr.path)
        parse_into(hdr, raw, fast, keep)

    def counted_parse_index(idx: Any, raw: bytes, *, fast: bool = True) -> None:
        seen.note("index", raw, idx.path)
        parse_index(idx, raw, fast=fast)

    monkeypatch.setattr(H, "_parse_into", counted_parse_into)
    monkeypatch.setattr(I, "parse_index", counted_parse_index)
    monkeypatch.setattr(R, "parse_index", counted_parse_index)
    return seen


def _run(readings: Readings, *args: object, fast: bool = True) -> None:
    res = invoke(*args, env={FAST_PATHS["metadata"].env: "1" if fast else "0"})
    assert res.exit_code == 0, (res.stdout, res.stderr)
    assert readings.again() == [], f"ckptctl {' '.join(map(str, args))} read these again: {readings.again()}"


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
@pytest.mark.parametrize("command", ["verify --static", "inspect --json", "export", "repair (no-op)"])
def test_each_header_and_the_index_are_decoded_once(tmp_path: Path, readings: Readings, command: str,
                                                    fast: bool) -> None:
    d = tmp_path / "ck"
    shards = _llama(d)
    args: tuple[object, ...] = {"verify --static": ("verify", d, "--static", "-q"),
                                "inspect --json": ("inspect", d, "--json"),
                                "export": ("export", d, tmp_path / "out", "-q"),
                                "repair (no-op)": ("resave", "--repair", d, "--static", "-q")}[command]
    _run(readings, *args, fast=fast)
    assert readings.count("header") == len(shards)  # every shard's header, each once
    assert readings.count("index") == 1


def test_verify_with_the_model_class_check_decodes_each_header_once(tmp_path: Path, readings: Readings) -> None:
    pytest.importorskip("transformers")
    d = tmp_path / "ck"
    shards = _llama(d)
    _run(readings, "verify", d, "-q")
    assert readings.count("header") == len(shards) and readings.count("index") == 1


def _misplaced(d: Path) -> list[str]:
    """The Llama with an index that names a tensor in the wrong shard: a repair writes a new
    index and hard-links every shard into its staged version, which it verifies before it
    publishes."""
    shards = _llama(d)
    idx = d / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["model.norm.weight"] = shards[0]
    idx.write_text(json.dumps(doc, indent=2))
    return shards


def _repair(readings: Readings, d: Path) -> None:
    res = invoke("resave", "--repair", d, "--static", "-q")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    doc = json.loads((d / "model.safetensors.index.json").read_text())
    assert doc["weight_map"]["model.norm.weight"] == sorted(set(doc["weight_map"].values()))[-1]  # repaired


def test_a_repair_and_the_verify_of_its_staged_version_decode_each_header_once(tmp_path: Path,
                                                                                 readings: Readings) -> None:
    d = tmp_path / "ck"
    shards = _misplaced(d)
    _repair(readings, d)
    assert [w for w, _, _ in readings.again()].count("header") == 0
    assert readings.count("header") == len(shards)


def test_a_repair_parses_each_index_once(tmp_path: Path, readings: Readings) -> None:
    d = tmp_path / "ck"
    _misplaced(d)
    _repair(readings, d)
    assert readings.again() == []
    assert readings.count("index") == 2  # the broken one, then the one the repair wrote (its staged verify)


def test_the_count_sees_a_second_reading(tmp_path: Path, readings: Readings) -> None:
    """The wrapping counts what it should: two readings of the same shard, or of two copies of
    it, are the same content decoded twice."""
    from ckptctl.format.header import read_header
    from ckptctl.layout.reading import MetadataReading

    d = tmp_path / "ck"
    shards = _llama(d)
    (d / "copy.safetensors").write_bytes((d / shards[0]).read_bytes())
    read_header(d / shards[0])
    read_header(d / "copy.safetensors")
    assert [(w, n) for w, n, _ in readings.again()] == [("header", 2)]
    reading = MetadataReading()
    before = readings.count("header")
    reading.header(d / shards[1])
    reading.header(d / shards[1])
    reading.header(d / "copy.safetensors")  # the bytes of shards[0]: decoded by this reading once
    assert readings.count("header") == before + 2


def _one_tensor(path: Path, value: float, *, name: str = "w", rows: int = 2) -> None:
    save_file({name: np.full((rows, 2), value, np.float32)}, str(path), metadata={"format": "pt"})


def test_a_header_rewritten_in_place_is_decoded_anew(tmp_path: Path, readings: Readings) -> None:
    """The same size and time stamps, other bytes (another tensor name of the same length): the
    reading decodes the file as it is now."""
    import os

    from ckptctl.layout.reading import MetadataReading

    p = tmp_path / "model.safetensors"
    _one_tensor(p, 1.0, name="a")
    reading = MetadataReading()
    assert list(reading.header(p).tensors) == ["a"]
    st = os.stat(p)
    _one_tensor(p, 1.0, name="b")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(p).st_size == st.st_size
    assert list(reading.header(p).tensors) == ["b"]
    assert list(reading.header(p).tensors) == ["b"] and readings.count("header") == 2


def test_a_header_with_findings_is_decoded_again_under_another_name(tmp_path: Path, readings: Readings) -> None:
    """A finding names the path it was found at: the same broken bytes under another name are
    decoded again and named there; a clean header is shared, shown at each path, and every read
    gets its own findings list."""
    from ckptctl.layout.reading import MetadataReading

    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    _one_tensor(good, 1.0)
    blob = bytearray(good.read_bytes())
    bad.write_bytes(bytes(blob) + b"\0" * 8)  # trailing bytes after the data: a finding
    reading = MetadataReading()
    first = reading.header(bad, display="one")
    again = reading.header(bad, display="two")
    assert first.findings and {f.path for f in first.findings} == {"one"}
    assert {f.path for f in again.findings} == {"two"}
    assert readings.count("header") == 2
    first.findings.clear()
    assert reading.header(bad, display="one").findings  # the kept reading is not the caller's list
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(good.read_bytes())
    a, b = reading.header(good), reading.header(copy)
    assert (a.path, b.path) == (str(good), str(copy)) and not a.findings and a.tensors is b.tensors
    assert readings.count("header") == 3


def test_a_header_over_the_kept_size_is_known_by_its_digest(tmp_path: Path, readings: Readings,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptctl.layout import reading as reading_mod

    monkeypatch.setattr(reading_mod, "KEEP_BYTES", 16)
    p, q = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _one_tensor(p, 1.0, name="a")
    _one_tensor(q, 1.0, name="b")  # the same sizes, other bytes
    reading = reading_mod.MetadataReading()
    assert list(reading.header(p).tensors) == ["a"] and list(reading.header(q).tensors) == ["b"]
    assert list(reading.header(p).tensors) == ["a"]
    assert readings.count("header") == 2
    assert all(len(known) == 32 for kept in reading._headers.values() for known, _ in kept)
