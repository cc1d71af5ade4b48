"""Loading a checkpoint directory back the ways real users do, and comparing state dicts.

* :func:`load_glob`: every ``*.safetensors`` (what a glob loader such as vLLM's sees);
* :func:`load_hub`: huggingface_hub's own ``load_torch_model`` (index first, else the one
  ``*.safetensors``), into a model that records what it is given, dtypes untouched;
* :func:`load_single_first`: transformers' rule (``model.safetensors`` first, else the index);
* :func:`load_with_transformers`: ``from_pretrained`` itself, for tiny real models.

:func:`same` is the equality every test uses: same names, and for each tensor the same dtype,
shape and bytes. ``torch.equal`` alone is not enough: it says a float32 tensor equals its
float16 copy, and it says ``-0.0 == 0.0`` while calling ``nan != nan``.
"""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path
from typing import Any, Callable

import torch

from tests.support.builders import INDEX, SINGLE

State = dict[str, torch.Tensor]


class LoadError(ValueError):
    """A loader found a checkpoint it would load wrongly (a tensor twice, an index that lies)."""


def load_glob(d: Path) -> State:
    """All tensors of every ``*.safetensors`` in ``d``; a tensor in two files is an error."""
    from safetensors.torch import load_file

    out: State = {}
    for f in sorted(d.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k in out:
                raise LoadError(f"{k} in two files")
            out[k] = v
    return out


_Keys = namedtuple("_Keys", "missing_keys unexpected_keys")  # what Module.load_state_dict returns


class _Recorder(torch.nn.Module):
    """The model huggingface_hub loads into: it keeps every tensor as given (a real module would
    cast it to its parameter's dtype) and refuses a name loaded twice."""

    def __init__(self) -> None:
        super().__init__()
        self.got: State = {}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        for k, v in state_dict.items():
            if k in self.got:
                raise LoadError(f"{k} loaded twice")
            self.got[k] = v
        return _Keys([], [])


def load_hub(d: Path) -> State:
    """What ``huggingface_hub.load_torch_model(model, d)`` loads (index first). The index must name
    exactly the tensors its shards hold (the hub only logs a warning when it does not)."""
    from huggingface_hub import load_torch_model

    rec = _Recorder()
    load_torch_model(rec, d)
    if (d / INDEX).exists():
        names = set(json.loads((d / INDEX).read_text())["weight_map"])
        if names != set(rec.got):
            raise LoadError(f"index and shards disagree: {sorted(names ^ set(rec.got))[:5]}")
    return rec.got


def load_single_first(d: Path) -> State:
    """transformers' rule: ``model.safetensors`` when there is one, else the index."""
    from safetensors.torch import load_file

    if (d / SINGLE).exists():
        return load_file(str(d / SINGLE))
    return load_hub(d)


LOADERS: dict[str, Callable[[Path], State]] = {
    "glob": load_glob, "index-first": load_hub, "single-first": load_single_first}


def load_with_transformers(d: Path, model_class: Any = None) -> Any:
    """``from_pretrained(d)`` with the checkpoint's own dtype (``AutoModelForCausalLM`` unless
    ``model_class`` is given); returns the model in eval mode."""
    import transformers

    cls = model_class or transformers.AutoModelForCausalLM
    return cls.from_pretrained(d, dtype="auto").eval()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def differences(a: State, b: State, limit: int = 5) -> list[str]:
    """Why ``a`` and ``b`` are not the same state dict (at most ``limit`` reasons; empty when same)."""
    out = []
    if set(a) != set(b):
        out.append(f"only in the first: {sorted(set(a) - set(b))[:limit]}, "
                   f"only in the second: {sorted(set(b) - set(a))[:limit]}")
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype:
            out.append(f"{k}: dtype {x.dtype} != {y.dtype}")
        elif tuple(x.shape) != tuple(y.shape):
            out.append(f"{k}: shape {tuple(x.shape)} != {tuple(y.shape)}")
        elif not torch.equal(_raw(x), _raw(y)):
            out.append(f"{k}: different bytes")
        if len(out) >= limit:
            break
    return out


def same(a: State, b: State) -> bool:
    """Same names; each tensor with the same dtype, shape and bytes."""
    return not differences(a, b, limit=1)
