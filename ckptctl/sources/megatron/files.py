"""Where a Megatron-core ``torch_dist`` checkpoint is, and its ``common.pt``, read without torch.

Megatron-LM's ``save_checkpoint`` (``--ckpt-format torch_dist``) writes, under its ``--save``
directory, ``latest_checkpointed_iteration.txt`` (the last iteration, or ``release``) and one
``iter_NNNNNNN/`` (or ``release/``) per save holding torch DCP's ``.metadata`` and
``__R_I.distcp`` files, Megatron's ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``)
and ``common.pt``: a ``torch.save`` archive of what is not sharded, among it ``args`` (the
``argparse.Namespace`` of the run) and ``checkpoint_version``. :func:`find_megatron` accepts the
``--save`` directory (the tracker names the iteration) or one iteration folder.

``common.pt``'s pickle is read by the allow-list unpickler of :mod:`ckptctl.format.torch_pickle`:
``argparse.Namespace`` and Megatron's enums (:data:`MEGATRON_GLOBALS`) become data records
(nothing of Megatron is imported or run), any other global an inert stub that is listed (its
value is then unknown; ``args`` must be a namespace of plain values).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptctl.errors import InputError, from_oserror
from ckptctl.format.small import TooLarge, read_small
from ckptctl.format.torch_pickle import DataObject, load_pickles
from ckptctl.sources.megatron.locate import COMMON, META_JSON
from ckptctl.sources.torch_archive import open_regular, read_archive_pickle

MAX_COMMON_PICKLE = 64 << 20  # args, scheduler and param groups: a few hundred KiB in real runs
# Read as data records from common.pt (never imported): the run's argument namespace and
# Megatron's enums that it holds.
MEGATRON_GLOBALS = frozenset({
    "argparse.Namespace",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.enums.ModelType",
    "megatron.core.model_parallel_config.ModelParallelConfig",
})
_AGAIN = "save the checkpoint again, or copy the missing files from the training run"


@dataclass
class Common:
    """What ``common.pt`` says: the run's arguments (plain values only), the checkpoint version,
    the iteration, and the globals it names that were read as inert stubs."""

    args: dict[str, Any] | None
    version: Any = None
    iteration: Any = None
    stubs: list[str] = field(default_factory=list)


def backend(folder: Path) -> str | None:
    """The ``sharded_backend`` Megatron's ``metadata.json`` names (None when absent)."""
    import json

    try:
        doc = json.loads(read_small(folder / META_JSON, limit=1 << 16))
    except (OSError, TooLarge, ValueError):
        return None
    value = doc.get("sharded_backend") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """A namespace value as data: plain values as they are, an enum record as its value's name
    (``AttnBackend(5)`` -> 5), a torch dtype stub as its name; anything else None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    if isinstance(value, DataObject):
        return value.value if isinstance(value.value, (int, str)) else None
    name = getattr(value, "name", None)
    return f"torch.{name}" if type(value).__name__ == "_DtypeStub" and isinstance(name, str) else None


def read_common(folder: Path) -> tuple[Common, Any]:
    """``common.pt`` of ``folder`` (and the identity of the file read, for pinning); an absent
    file gives ``Common(None)``. Raises InputError for a damaged one."""
    from ckptctl.sources.base import read_pinned

    path = folder / COMMON
    if not path.exists():
        return Common(None), None
    return read_pinned(path, lambda: _read_common(path))


def _read_common(path: Path) -> Common:
    fd = open_regular(path)
    try:
        raw = read_archive_pickle(fd, str(path), MAX_COMMON_PICKLE, _AGAIN)[0]
    except OSError as exc:
        raise from_oserror(exc, "cannot read common.pt") from None
    finally:
        os.close(fd)
    objs, stubs, err = load_pickles(raw, data_globals=MEGATRON_GLOBALS)
    if err or not objs or not isinstance(objs[0], dict):
        raise InputError(f"{path} is not a readable Megatron common state ({err or 'not a dict'})", _AGAIN)
    obj = objs[0]
    ns = obj.get("args")
    args = None
    if isinstance(ns, DataObject) and isinstance(ns.state, dict):
        args = {str(k): _plain(v) for k, v in ns.state.items()}
    return Common(args, obj.get("checkpoint_version"), obj.get("iteration"), sorted(set(stubs)))


RUN_CONFIG = "run_config.yaml"  # Megatron-Bridge / NeMo-RL: the run's ConfigContainer, in the iteration folder
MAX_RUN_CONFIG = 4 << 20


def read_run_config(folder: Path) -> dict[str, Any] | None:
    """``run_config.yaml`` of ``folder`` as data (None when absent), bounded: at most 4 MiB, no
    anchors or aliases (a YAML bomb), no tags (nothing constructed but plain values). Raises
    InputError for one that is not a readable mapping."""
    path = folder / RUN_CONFIG
    if not path.exists():
        return None
    import yaml

    class _Plain(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("anchors and aliases are not read")
            return super().compose_node(parent, index)

    try:
        text = read_small(path, limit=MAX_RUN_CONFIG).decode()
        doc = yaml.load(text, Loader=_Plain)  # noqa: S506 - a SafeLoader without aliases
    except (OSError, TooLarge, UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise InputError(f"{path} is not a readable run configuration ({type(exc).__name__}: {exc})"[:400],
                         "pass the model's Hugging Face config.json with --config CONFIG_JSON instead") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path} is not a mapping", "pass the model's config.json with --config CONFIG_JSON instead")
    return doc
