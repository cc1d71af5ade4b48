"""The tensors of a ``torch.save`` zip archive's state dict, as names, dtypes and shapes, with the
groups of names that share one view (tied weights), read by :mod:`ckptctl.format.torch_pickle`
(nothing imported, nothing run). Used where two saves of one model are compared without torch
(``pytorch_model.bin`` beside ``model.safetensors``)."""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

from ckptctl.format.tensor import TensorSpec
from ckptctl.format.torch_pickle import TensorRef, load_pickles

MAX_DATA_PKL = 256 << 20  # a state dict's data.pkl is a few hundred bytes per tensor


@dataclass(frozen=True)
class PickleSpecs:
    """A flat state dict of tensors: their specs, and the names grouped by the view they share
    (a group of one for an untied tensor)."""

    specs: dict[str, TensorSpec]
    groups: list[list[str]]


def state_dict_specs(path: str | os.PathLike[str]) -> PickleSpecs | None:
    """The tensors of the ``torch.save`` zip archive at ``path``, or None when they cannot be told
    exactly: not a regular file or zip archive, no single ``data.pkl``, a pickle the allow-list
    refuses, not a flat dict of tensors, a tensor whose dtype or arguments the records cannot say.
    Never raises for a bad file; OSError only from the operating system."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode) or not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as zf:
            pkls = [i for i in zf.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
            if len(pkls) != 1 or pkls[0].file_size > MAX_DATA_PKL:
                return None
            data = zf.read(pkls[0])
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError, zlib.error):
        return None
    objs, unsafe, err = load_pickles(data)
    if err or unsafe or not objs or not isinstance(objs[0], dict):
        return None
    return _flat(objs[0])


def _flat(obj: dict[Any, Any]) -> PickleSpecs | None:
    specs: dict[str, TensorSpec] = {}
    by_view: dict[tuple[Any, ...], list[str]] = {}
    for k, v in obj.items():
        if not isinstance(v, TensorRef) or not v.exact or v.dtype is None or str(k) in specs:
            return None
        name = str(k)
        specs[name] = v.spec(name)
        tied = v.storage is not None and not v.storage.retyped  # a re-typed storage's view is no tie
        view = (v.storage.key, v.offset, v.shape, v.stride) if tied else (name,)
        by_view.setdefault(view, []).append(name)
    return PickleSpecs(specs, [sorted(g) for g in by_view.values()])
