"""The source kinds: one record per kind, in the one order a path is probed.

export (``sources/opener.py``), inspect (``inspect.py``) and verify (``verify/pipeline.py``) ask
:func:`locate` which kind a path is and call that kind's hooks; ``--only`` choices, help texts
and shell completion read :data:`KINDS`. Nothing else lists kinds: adding one is its subpackage,
one line here and its docs (``docs/ARCHITECTURE.md``, "How to add a source kind").

A kind is either *located* (``locate`` set: a training framework's or torch's own layout, found
by a cheap probe of names and small files, asked before the ordinary layout, in the order of
:data:`KINDS`), or a *family* of the ordinary layout (``locate`` None: ``layout.scan`` finds it
and ``layout.choose`` picks it, ``--only`` being its preference). Hooks are named, not imported:
``"module:function"``, resolved by :meth:`Kind.hook` when that kind is chosen, so a command
imports the reader of the kind it reads and no other (the probes' modules import no reader).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ckptctl.errors import InputError, UsageError


class Kind(NamedTuple):
    """One source kind (module docstring)."""

    name: str  # its --only value, and inspect's and verify's word for it
    summary: str  # one line, for help and completion
    locate: str | None  # "module:function" (path -> a location or None; may raise InputError); None: a layout family
    open: str  # "module:function": the export's Source
    inspect: str  # "module:function": what inspect shows for it
    verify: str  # "module:function": the checks verify runs on it
    codes: tuple[str, ...]  # the verify codes its checks report (docs/VERIFY_CODES.md); a located kind's last: damaged
    expect: str = ""  # a located kind: what --only says of a path that is not one ...
    expect_hint: str = ""  # ... and what to pass instead

    def hook(self, which: str) -> Callable[..., Any]:
        """The function a hook names (``which``: locate, open, inspect, verify), imported now."""
        target = getattr(self, which)
        module, _, func = target.partition(":")
        return getattr(importlib.import_module(module), func)


# The probe order: located kinds first (a ZeRO step folder's Trainer also leaves a bit16
# model.safetensors beside it, which is not what an export of the run means), then the layout's.
KINDS: tuple[Kind, ...] = (
    Kind("megatron", "Megatron-core torch_dist checkpoint: the --save root or an iter_N folder, mapped to HF names",
         "ckptctl.sources.megatron.locate:find_megatron", "ckptctl.sources.megatron.source:open_location",
         "ckptctl.inspect_kinds:inspect_megatron", "ckptctl.verify.megatron:check_megatron",
         ("megatron.checkpoint", "megatron.not_mapped", "megatron.damaged"),
         "is not a Megatron-core torch_dist checkpoint",
         "pass its --save directory (with latest_checkpointed_iteration.txt) or an iter_N folder"),
    Kind("zero", "DeepSpeed ZeRO 1/2/3 checkpoint: a root with latest or a global_stepN folder (fp32 masters)",
         "ckptctl.sources.zero.locate:find_zero", "ckptctl.sources.zero.source:open_location",
         "ckptctl.inspect_kinds:inspect_zero", "ckptctl.verify.zero:check_zero",
         ("zero.checkpoint", "zero.damaged"),
         "is not a DeepSpeed ZeRO checkpoint", "pass its root (with latest) or a global_stepN folder"),
    Kind("dcp-hf", "torch DCP-HF: HuggingFaceStorageWriter's sharded/ output, assembled from its shards",
         "ckptctl.sources.dcp.locate:find_sharded", "ckptctl.sources.dcp.hf:open_location",
         "ckptctl.inspect_kinds:inspect_dcp_hf", "ckptctl.verify.dcp:dcp_hf_located",
         ("dcp.hf_sharded", "dcp.hf_damaged"),
         "holds no DCP-HF shards (torch's HuggingFaceStorageWriter sharded/ output)",
         "drop --only dcp-hf, or pass the directory that holds sharded/"),
    Kind("safetensors", "safetensors: model.safetensors or its shards with an index (variants too)",
         None, "ckptctl.sources.opener:open_family", "ckptctl.inspect:add_family", "ckptctl.verify.index:family_tensors",
         ("header.bad_offsets", "index.tensor_missing")),
    Kind("pytorch", "PyTorch pickles: pytorch_model*.bin, *.pt, *.pth (read as data, never executed)",
         None, "ckptctl.sources.opener:open_family", "ckptctl.inspect:add_family", "ckptctl.verify.index:family_tensors",
         ("pickle.unsafe_global", "pickle.bad_archive")),
    Kind("peft", "PEFT adapter: adapter_config.json with adapter_model.safetensors or .bin",
         None, "ckptctl.sources.opener:open_family", "ckptctl.inspect:add_family", "ckptctl.verify.peft:adapter_step",
         ("adapter.missing_keys", "adapter.rank_mismatch")),
    Kind("dcp", "torch DCP: .metadata and its .distcp files (a training state needs --key)",
         None, "ckptctl.sources.opener:open_family", "ckptctl.inspect:add_family", "ckptctl.verify.dcp:check_dcp",
         ("dcp.bad_metadata", "dcp.chunk_missing")),
)
NAMES: tuple[str, ...] = tuple(k.name for k in KINDS)
# What else --only may name: between a single file and a sharded family of one kind, which one
# (layout.choose applies it).
SHAPES = ("index", "single")
# What --only may name: a kind, or a shape.
ONLY_CHOICES = (*NAMES, *SHAPES)
# --names: the names an export writes. hf (the default): the library's own, mapped where the
# source is a training framework's (Megatron); megatron: a Megatron checkpoint's names as they are.
NAMES_CHOICES = ("hf", "megatron")
LOCATED: tuple[Kind, ...] = tuple(k for k in KINDS if k.locate is not None)
FAMILIES: tuple[str, ...] = tuple(k.name for k in KINDS if k.locate is None)  # the layout's family kinds
BY_NAME: dict[str, Kind] = {k.name: k for k in KINDS}  # read-only after import


class KindError(InputError):
    """A located kind's probe found its kind at a path, damaged (a tracker naming a missing step)."""

    def __init__(self, kind: Kind, exc: InputError) -> None:
        super().__init__(exc.message, exc.hint)
        self.kind = kind


class Located(NamedTuple):
    """A located kind at a path, and where its probe says the checkpoint is."""

    kind: Kind
    location: Any


def locate(path: Path, *, only: str | None = None) -> Located | None:
    """The located kind that ``path`` is, asked in :data:`KINDS` order, or None (the layout's
    families then decide). ``only`` names a kind: a located one must be there (else a usage error
    saying what was expected), a layout family's skips every probe. Raises InputError where a
    probe finds its kind damaged (a tracker naming a missing iteration)."""
    for kind in LOCATED:
        if only not in (None, kind.name):
            continue
        try:
            location = kind.hook("locate")(path)
        except InputError as exc:
            raise KindError(kind, exc) from None
        if location is not None:
            return Located(kind, location)
        if only is not None:
            raise UsageError(f"{path} {kind.expect}", kind.expect_hint)
    return None


def dir_names(p: Path) -> list[str] | None:
    """The names in directory ``p``, or None when ``p`` is not a directory that can be listed (a
    probe then says "not mine"; the ordinary scan reports what cannot be read). Here, beside the
    registry, so that a probe imports no reader's base."""
    try:
        return os.listdir(p) if p.is_dir() else None
    except OSError:
        return None


def only_help(*extra: str) -> str:
    """The --only help text: every kind's name, then ``extra`` choices."""
    return "Which weights: " + ", ".join((*NAMES, *extra)) + "."
