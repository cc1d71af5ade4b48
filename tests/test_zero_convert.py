"""The ZeRO source's torch-free fp32 -> bf16 / fp16 conversion (``sources/zero/convert.py``) gives
torch's bytes (the reference, ``base.convert_bytes``) on every kind of value, and the export is
the same both ways (``CKPTCTL_FAST_CONVERT=0`` switches the fast path off)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ckptctl.sources.base import convert_bytes
from ckptctl.sources.zero.convert import STEP, convert_chunks
from tests.support import invoke
from tests.test_layering import probe
from tests.test_zero_build import NEEDS_DEEPSPEED, ckpt, zero_ckpts  # noqa: F401 - the fixture


def _hard_values() -> np.ndarray:
    """fp32 bit patterns: ties at both roundings, subnormals, zeros, infinities, the largest
    finite values, fp16's overflow and subnormal edges, and random patterns (no NaN)."""
    rng = np.random.default_rng(0)
    upper = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << np.uint32(16)
    ties = np.concatenate([upper | 0x8000, upper | 0x7FFF, upper | 0x8001, upper])  # even and odd tops
    special = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x007FFFFF, 0x7F800000, 0xFF800000, 0x7F7FFFFF,
                        0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF], dtype=np.uint32)
    fp16_edges = np.array([65504.0, 65519.99, 65520.0, -65520.0, 6.1e-5, 5.96e-8, 2.98e-8, 1e-9],
                          dtype=np.float32).view(np.uint32)
    bits = rng.integers(0, 1 << 32, 1 << 21, dtype=np.uint64).astype(np.uint32)
    bits = bits[(bits & 0x7FFFFFFF) <= 0x7F800000]  # NaN chunks go to the reference whole
    normal = rng.standard_normal(1 << 20).astype(np.float32).view(np.uint32)
    return np.concatenate([ties, special, fp16_edges, bits, normal])


@pytest.mark.parametrize("dst", ["BF16", "F16"])
def test_fast_conversion_is_torchs_bit_for_bit(dst):
    raw = _hard_values().tobytes()
    assert len(raw) // 4 > STEP  # several steps
    fast = b"".join(bytes(c) for c in convert_chunks(raw, "F32", dst))
    assert fast == convert_bytes(raw, "F32", dst)


@pytest.mark.parametrize("dst", ["BF16", "F16"])
def test_a_step_with_a_nan_is_converted_by_the_reference(dst):
    nans = np.array([np.nan, 0x7F800001, 0xFFC00000, 0x7FBFFFFF], dtype=np.float32)
    nans[1:] = np.array([0x7F800001, 0xFFC00000, 0x7FBFFFFF], dtype=np.uint32).view(np.float32)
    values = np.random.default_rng(1).standard_normal(2 * STEP + 10).astype(np.float32)
    values[[3, STEP + 5, STEP + 6, 2 * STEP + 9]] = nans  # in the first step, the second, the last
    raw = values.tobytes()
    assert b"".join(bytes(c) for c in convert_chunks(raw, "F32", dst)) == convert_bytes(raw, "F32", dst)
    assert b"".join(bytes(c) for c in convert_chunks(raw, "F32", dst, fast=False)) == convert_bytes(raw, "F32", dst)


@NEEDS_DEEPSPEED
def test_bf16_export_is_the_same_both_ways_and_the_fast_way_needs_no_torch(zero_ckpts, tmp_path):
    src = ckpt(zero_ckpts["s3_bf16"])
    out = {}
    for flag in ("1", "0"):
        r = invoke("export", src, tmp_path / flag, "--dtype", "bf16", "--json", env={"CKPTCTL_FAST_CONVERT": flag})
        assert r.exit_code == 0, r.stdout + r.stderr
        out[flag] = (tmp_path / flag / "model.safetensors").read_bytes()
    assert out["1"] == out["0"]
    result, stdout = probe(["export", src, tmp_path / "probe", "--dtype", "fp16", "--json"])
    assert json.loads(stdout)["ok"] is True and result["exit"] == 0 and "torch" not in result["heavy"]
