"""Torch-side helpers the oracles share: the meta tensors standing for a checkpoint's tensors,
and silencing the libraries' loggers, warnings and progress bars while a class is built (the core
prints nothing). Imported only when a class check runs."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from ckptctl.format.tensor import TensorSpec

# safetensors dtype names -> torch dtype attribute names (a dtype torch lacks becomes uint8: the
# class check compares names and shapes; every loader casts floats to the model's dtype)
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
                "C64": "complex64"}


def meta_state_dict(tensors: Mapping[str, TensorSpec]) -> dict[str, Any]:
    """Every tensor as an empty tensor on the meta device: its shape and dtype, no memory. Names
    of one dtype and shape share one meta tensor (DeepSeek-V3's 91,991 names have 7): a meta
    tensor holds no values, and no loader step changes a tensor's shape in place."""
    import torch

    by_name: dict[str, Any] = {}
    made: dict[tuple[str, tuple[int, ...]], Any] = {}
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        shape = tuple(t.shape)
        m = made.get((t.dtype, shape))
        if m is None:
            dt = by_name.get(t.dtype)
            if dt is None:
                dt = by_name[t.dtype] = getattr(torch, TORCH_DTYPES.get(t.dtype, "uint8"), torch.uint8)
            m = made[(t.dtype, shape)] = torch.empty(shape, dtype=dt, device="meta")
        out[name] = m
    return out


@contextlib.contextmanager
def silenced(*libraries: str) -> Iterator[None]:
    """The libraries' loggers at ERROR, their progress bars off and Python warnings ignored, for
    the duration; every setting is put back as it was."""
    saved: list[tuple[logging.Logger, int]] = []
    restore: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in libraries:
            lg = logging.getLogger(name)
            saved.append((lg, lg.level))
            lg.setLevel(logging.ERROR)
        try:
            if "transformers" in libraries:
                from transformers.utils import logging as tlog

                if tlog.is_progress_bar_enabled():
                    tlog.disable_progress_bar()
                    restore.append(tlog.enable_progress_bar)
            yield
        finally:
            for fn in restore:
                fn()
            for lg, level in saved:
                lg.setLevel(level)
