"""What a path holds: weight families, extras, leftovers and ambiguities. The one model of a
checkpoint directory that every command reads.

A *family* is one set of weights files that together form a checkpoint: a single file, or shards
with their index. Files are grouped by their library name (``ckptctl.format.names``): stem
(``model``, ``pytorch_model``, ``diffusion_pytorch_model``, ``adapter_model``), container
(safetensors or pickle) and variant (``model.fp16.safetensors``). Each index is parsed here, once,
and kept on its family (``Family.index_doc``) with its findings in ``Layout.findings``; nobody
re-reads it. torch DCP directories, lone ``.pt`` files and stray ``*.safetensors`` files are
families too. Anything ambiguous is reported as a finding, never resolved by a silent guess;
:func:`choose` is the one policy that picks a family where a command must read one.

Modules: ``model`` (the data: kinds, :class:`Family`, :class:`Component`, :class:`Layout`),
``scan`` (a path -> a Layout), ``components`` (multi-component roots), ``policy`` (:func:`choose`).
"""

from __future__ import annotations

from ckptctl.layout.model import (COPIED_EXTRAS, DCP, DCP_HF, EXTRA_NAMES, MODEL, MODEL_INDEX, MODULES_JSON, PEFT,
                                  PIPELINE, PT_INDEX, PYTORCH, ROOTS, SAFETENSORS, SENTENCE_TRANSFORMERS, ST_INDEX,
                                  Component, Family, Layout, is_leftover, named_slot, safetensors_stem, slot_of)
from ckptctl.layout.policy import Assessment, candidates, choose
from ckptctl.layout.scan import scan

__all__ = [
    "COPIED_EXTRAS", "DCP", "DCP_HF", "EXTRA_NAMES", "MODEL", "MODEL_INDEX", "MODULES_JSON", "PEFT", "PIPELINE",
    "PT_INDEX", "PYTORCH", "ROOTS", "SAFETENSORS", "SENTENCE_TRANSFORMERS", "ST_INDEX", "Assessment", "Component",
    "Family", "Layout", "candidates", "choose", "is_leftover", "named_slot", "safetensors_stem", "scan", "slot_of",
]
