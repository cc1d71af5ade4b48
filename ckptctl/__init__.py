"""ckptctl: export, repair, verify and clean up Hugging Face-style safetensors checkpoints.

The library API is importable without the CLI (this module never imports ``ckptctl.cli``) and
without torch; names are resolved lazily on first use.
"""

from __future__ import annotations

from typing import Any

from ckptctl._version import __version__

_LAZY = {
    "CkptctlError": "ckptctl.errors",
    "Finding": "ckptctl.findings",
    "read_header": "ckptctl.format.header",
    "encode_header": "ckptctl.format.header",
    "scan": "ckptctl.layout",
    "inspect_path": "ckptctl.inspect",
    "export": "ckptctl.api",
    "save_state_dict": "ckptctl.api",
    "CheckpointWriter": "ckptctl.api",
    "ExportOptions": "ckptctl.write.options",
    "ExportResult": "ckptctl.write.job",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckptctl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
