"""A corpus of checkpoints written by the real libraries, for tests of ckptctl.

Every entry is a directory a real library wrote with its own writer (``save_pretrained``,
``SentenceTransformer.save``, ``dcp.save``, ``Trainer.train`` ...) from tiny models built from
configs under fixed seeds (nothing is downloaded), together with that library's own loader::

    from ecosystem import ENTRIES, by_name, fresh_copy

    entry = by_name("transformers/llama-sharded")
    entry.build(d)          # writes the checkpoint into the empty directory d
    entry.load(d)           # the library's loader -> {name: tensor} (bit-exact comparisons: compare())
    entry.forward(d)        # the loaded model's output on a fixed input (None where meaningless)
    entry.parameters        # what the library's model counts (tied parameters once)

In tests, use the session fixtures of ``ecosystem.fixtures`` (enable them with
``pytest_plugins = ["ecosystem.fixtures"]`` in the test module): ``ecosystem`` (every buildable entry
built once per session: name -> directory) and ``build_one`` (``build_one(name)`` builds just that
one, once). Those directories are shared: never modify them, ``fresh_copy(src, dst)`` first.
Import this package as ``ecosystem`` (tests/ is on sys.path), never as ``tests.ecosystem``: the
two names would be two registries.

``load`` gives the tensors under the names the library's loaded object uses, which are not always
the file's (transformers 5 fuses MoE experts and renames VLM prefixes on load: see ``notes``): to
check a rewritten checkpoint, compare ``load(original)`` with ``load(rewritten)``. Tensor dicts of
entries that hold several models use ``<part>/<name>`` keys: pipeline components
(``unet/…``), families side by side (``main/…``, ``fp16/…``), training state (``model/…``,
``optimizer/…``, ``step``). Per-entry details are in ``Entry.notes`` and the module docstrings.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .entry import Entry, Recipe, Reference

if TYPE_CHECKING:
    import torch

__all__ = ["ENTRIES", "LIBRARIES", "Entry", "Reference", "build", "by_name", "compare", "dirname", "fresh_copy",
           "missing_libraries", "reference"]

MODULES = ("transformers_models", "transformers_layouts", "diffusers_models", "st_models", "peft_models",
           "dcp_models", "misc")
LIBRARIES = ("transformers", "diffusers", "sentence-transformers", "peft", "accelerate", "dcp", "hub", "safetensors")


def _recipes() -> dict[str, Recipe]:
    out: dict[str, Recipe] = {}
    for module in MODULES:
        for r in importlib.import_module(f"{__name__}.{module}").recipes():
            if r.name in out:
                raise ValueError(f"duplicate corpus entry {r.name!r}")
            out[r.name] = r
    return out


RECIPES: dict[str, Recipe] = _recipes()
ENTRIES: list[Entry] = [r.entry() for r in RECIPES.values()]
_BY_NAME: dict[str, Entry] = {e.name: e for e in ENTRIES}


def by_name(name: str) -> Entry:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no corpus entry {name!r}; known: {', '.join(sorted(_BY_NAME))}") from None


def reference(name: str) -> Reference:
    """The in-memory side of ``name``: tensors, output and parameter count of the object that wrote it
    (rebuilt under the same seeds; for entries written by other processes or while training, the same
    computation done here)."""
    return RECIPES[by_name(name).name].reference()


def missing_libraries(name: str) -> list[str]:
    """Import names ``name`` needs that are not installed (its tests skip with them as the reason)."""
    needed = ("torch", *RECIPES[by_name(name).name].requires)
    return [m for m in needed if importlib.util.find_spec(m) is None]


def dirname(name: str) -> str:
    """The directory name an entry is built under (``transformers/llama`` -> ``transformers__llama``)."""
    return name.replace("/", "__")


def build(name: str, dest: Path) -> Path:
    """Write entry ``name`` into ``dest`` (created; it must not exist or be empty). Returns ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty")
    by_name(name).build(dest)
    return dest


def fresh_copy(src: Path, dst: Path) -> Path:
    """A private, modifiable copy of a built entry (symlinks copied as links: the HF cache's relative
    ``snapshots/…`` -> ``../../blobs/…`` links resolve inside the copy). ``dst`` must not exist."""
    shutil.copytree(src, dst, symlinks=True)
    return Path(dst)


def compare(expected: dict[str, "torch.Tensor"], actual: dict[str, "torch.Tensor"]) -> list[str]:
    """Every difference between two tensor dicts: names, dtypes, shapes, bytes. Empty when bit-identical."""
    import torch

    problems = [f"missing {k}" for k in sorted(set(expected) - set(actual))]
    problems += [f"unexpected {k}" for k in sorted(set(actual) - set(expected))]
    for k in sorted(set(expected) & set(actual)):
        a, b = expected[k], actual[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{k}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            problems.append(f"{k}: bytes differ")
    return problems
