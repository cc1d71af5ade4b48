"""The corpus record (``Entry``) and the recipe every library module fills in (``Recipe``).

A recipe is four library calls and two views:

* ``make()``          the in-memory object the library writes from, built under fixed seeds (so a
                      second ``make()`` is bit-identical to the one that wrote the directory),
* ``save(obj, dir)``  the library's own writer,
* ``reload(dir)``     the library's own loader, returning an object of the same kind,
* ``tensors(obj)``    the tensors an object holds (what the bit-exact comparison looks at),
* ``run(obj)``        the output on a fixed input (None where meaningless),
* ``count(obj)``      what the library counts as the model's parameters.

``Entry`` (the public record) is derived from it: ``build = save(make())``, ``load = tensors(reload)``,
``forward = run(reload)``. ``reference(name)`` gives the in-memory side for the corpus's own tests.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Entry:
    name: str
    library: str
    layout: str
    build: Callable[[Path], None]
    load: Callable[[Path], dict[str, "torch.Tensor"]]
    forward: Callable[[Path], "torch.Tensor"] | None
    parameters: int | None
    notes: str = ""


@dataclass(frozen=True)
class Reference:
    """The in-memory side of an entry: what the object that wrote the directory holds."""

    tensors: dict[str, "torch.Tensor"]
    output: "torch.Tensor | None"
    parameters: int | None


@dataclass(frozen=True)
class Recipe:
    name: str
    library: str
    layout: str
    parameters: int | None
    make: Callable[[], Any]
    save: Callable[[Any, Path], None]
    reload: Callable[[Path], Any]
    tensors: Callable[[Any], dict[str, "torch.Tensor"]]
    run: Callable[[Any], "torch.Tensor"] | None = None
    count: Callable[[Any], int] | None = None
    notes: str = ""
    # import names the recipe needs beyond torch (a missing one skips the entry's tests)
    requires: tuple[str, ...] = field(default=())
    # the in-memory reference when it is not ``make()``: the writers are other processes (make gives
    # None), or the library writes while it trains (make gives the untrained setup)
    expected: Callable[[], Any] | None = None
    # True when ``save`` runs real subprocesses: ``build_all`` starts these first, in threads
    spawns: bool = False

    def build(self, d: Path) -> None:
        # no warnings.catch_warnings around a spawning build: it is process-global and this runs in a thread
        with contextlib.nullcontext() if self.spawns else quiet():
            self.save(self.make(), Path(d))

    def load(self, d: Path) -> dict[str, "torch.Tensor"]:
        with quiet():
            return self.tensors(self.reload(Path(d)))

    def forward(self, d: Path) -> "torch.Tensor":
        assert self.run is not None
        with quiet():
            obj = self.reload(Path(d))
            _realign(obj)
            return _no_grad(self.run, obj)

    def reference(self) -> Reference:
        with quiet():
            obj = (self.expected or self.make)()
            output = _no_grad(self.run, obj) if self.run is not None else None
            return Reference(self.tensors(obj), output, self.count(obj) if self.count is not None else None)

    def entry(self) -> Entry:
        return Entry(self.name, self.library, self.layout, self.build, self.load,
                     self.forward if self.run is not None else None, self.parameters, self.notes)


def _realign(obj: Any) -> None:
    """Every parameter and buffer of the loaded model(s) moved to fresh memory, where a loader left
    it inside a memory-mapped file. MKL's kernels on AVX-512 give other bits for the same values at
    another address modulo 64 (on this machine a diffusers UNet's output differed by 5e-7, first in a
    ``Linear`` given the same input and weights), and safetensors aligns tensors to 8 bytes only: without this, the forward pass would
    judge where the loader put the bytes, not the bytes. The in-memory reference is allocated fresh."""
    import torch

    if isinstance(obj, torch.nn.Module):
        for t in [*obj.parameters(), *obj.buffers()]:
            if t.data_ptr() % 64:
                t.data = t.data.clone()
    elif isinstance(obj, dict) or hasattr(obj, "components"):  # a family pair, a diffusers pipeline
        for part in (obj if isinstance(obj, dict) else obj.components).values():
            _realign(part)


def _no_grad(fn: Callable[[Any], "torch.Tensor"], obj: Any) -> "torch.Tensor":
    import torch

    with torch.no_grad():
        return fn(obj).detach()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Library chatter (deprecation notes, 'weights not initialized' tables) off while building."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    """Fixed seeds for torch, numpy and random inside, and the caller's RNG state back afterwards."""
    import random

    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def module_tensors(model: Any) -> dict[str, "torch.Tensor"]:
    """A torch module's state dict (tied tensors under each of their names), detached."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def count_parameters(model: Any) -> int:
    """sum(p.numel()) over ``model.parameters()``: a tied parameter counts once."""
    return sum(p.numel() for p in model.parameters())


def prefixed(parts: dict[str, dict[str, "torch.Tensor"]]) -> dict[str, "torch.Tensor"]:
    """Several models' tensors in one dict: ``<part>/<tensor name>``."""
    return {f"{part}/{k}": v for part, tensors in parts.items() for k, v in tensors.items()}


def fp16_beside_main(*, make: Callable[[], Any], shard: str | None, load: Callable[[Path, str | None], Any],
                     tensors: Callable[[Any], dict[str, "torch.Tensor"]], run: Callable[[Any], "torch.Tensor"],
                     count: Callable[[Any], int], **fields: Any) -> Recipe:
    """An object saved twice into one directory with ``save_pretrained``: its fp32 main family, then
    ``variant="fp16"`` of an fp16 copy (in this order: saving a sharded main family second would remove
    the variant's ``…-0000i-of-0000N`` shards). ``load(d, variant)`` loads one family (None: the main one).
    Tensors are ``main/<k>`` and ``fp16/<k>``; forward and parameters are the main family's."""
    def pair() -> dict[str, Any]:
        import copy

        import torch

        main = make()
        return {"main": main, "fp16": copy.deepcopy(main).to(torch.float16)}

    def save(objs: dict[str, Any], d: Path) -> None:
        kw = {"max_shard_size": shard} if shard else {}
        objs["main"].save_pretrained(d, **kw)
        objs["fp16"].save_pretrained(d, variant="fp16", **kw)

    return Recipe(make=pair, save=save, reload=lambda d: {"main": load(d, None), "fp16": load(d, "fp16")},
                  tensors=lambda objs: prefixed({k: tensors(m) for k, m in objs.items()}),
                  run=lambda objs: run(objs["main"]), count=lambda objs: count(objs["main"]), **fields)
