"""--deep, tied lm_head: the stored head is compared with the embedding window by window (bounded
memory, deep verify's reader), so a difference anywhere, the last window included, is found."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from ckptctl.format.header import read_header
from ckptctl.verify import PathResult, VerifyOptions, verify_path
from ckptctl.verify.context import Context
from ckptctl.verify.tied import same_bytes
from ecosystem import fresh_copy

pytest_plugins = ["ecosystem.fixtures"]
torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _with_head(build_one, tmp_path: Path, edit) -> Path:
    """The real tied Llama with a stored head: the embedding's bytes, changed by ``edit``."""
    d = fresh_copy(build_one("transformers/llama-tied"), tmp_path / "ckpt")
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is True
    p = d / "model.safetensors"
    tensors = st.load_file(p)
    head = tensors[EMBED].clone()
    edit(head.view(-1))
    tensors[HEAD] = head
    st.save_file(tensors, p, metadata={"format": "pt"})
    return d


def _differs(d: Path, chunk: int) -> bool:
    res = verify_path(d, options=VerifyOptions(deep=True, chunk_bytes=chunk))
    assert not [f for f in res.findings if f.code == "io.error"]
    return "config.lm_head_tied_differs" in {f.code for f in res.findings}


def _set(index: int):
    def fn(flat) -> None:
        flat[index] = flat[index] + 1.0
    return fn


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_difference_in_any_window_is_found(build_one, tmp_path: Path, where: str) -> None:
    d = _with_head(build_one, tmp_path, lambda flat: None)
    info = read_header(d / "model.safetensors").tensors[EMBED]
    size = info.end - info.begin
    assert size > 8 * 64, size  # many 64-byte windows
    assert not _differs(d, 64) and not _differs(d, 8 << 20)
    n = size // 4  # float32 elements
    d = _with_head(build_one, tmp_path / where, _set({"first": 0, "middle": n // 2, "last": n - 1}[where]))
    assert _differs(d, 64), where
    assert _differs(d, 8 << 20), where


def test_comparison_memory_is_bounded_by_the_window(tmp_path: Path) -> None:
    """Two 16 MiB tensors compared with 1 MiB windows: the peak Python allocation stays near two
    windows (reading both whole would take 32 MiB)."""
    emb = torch.randn(4096, 1024)
    head = emb.clone()
    head.view(-1)[-1] += 1.0
    p = tmp_path / "model.safetensors"
    st.save_file({EMBED: emb, HEAD: head}, p, metadata={"format": "pt"})
    hdr = read_header(p)
    ctx = Context(tmp_path, PathResult(str(tmp_path), str(tmp_path)), VerifyOptions(deep=True, chunk_bytes=1 << 20))
    where = [("model.safetensors", hdr.tensors[n], hdr.data_start) for n in (HEAD, EMBED)]
    tracemalloc.start()
    try:
        assert same_bytes(ctx, where[0], where[1]) is False
        assert same_bytes(ctx, where[1], where[1]) is True
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20, peak
