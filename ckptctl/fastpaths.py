"""Every fast path's switch, in one table: the one way to ask whether a fast path is on.

Each fast path lives behind one function beside the reference it must equal (``DESIGN.md`` I14),
and that function takes the switch as an argument (``fast=``, or ``max_pieces=0`` for the piece
lists), so the suite runs both ways. Where a command does not pass it, :func:`enabled` answers
from the path's environment variable: on unless it says ``0``. README's table of environment
variables lists each one (a test checks that every ``CKPTCTL_`` variable the package reads is
there)."""

from __future__ import annotations

import os
from typing import NamedTuple


class FastPath(NamedTuple):
    """One fast path: its switch, what it does and the reference it must equal."""

    env: str
    what: str
    reference: str


FAST_PATHS: dict[str, FastPath] = {  # read-only after import
    "metadata": FastPath("CKPTCTL_FAST_METADATA", "indexes and safetensors headers decoded by msgspec",
                         "json with the duplicate-key hook; the strict hand-walked header reader"),
    "table": FastPath("CKPTCTL_FAST_TABLE", "a command's result table written as rich draws it, without importing "
                      "rich, off a terminal (printable ASCII cells)", "rich's Table"),
    "follow-metadata": FastPath("CKPTCTL_FAST_FOLLOW_METADATA",
                                "export --follow: a waiting DCP save's .metadata parsed once per version of the file",
                                "the file read and parsed at every look"),
    "convert": FastPath("CKPTCTL_FAST_CONVERT", "a ZeRO export's fp32 masters converted to bf16/fp16 by numpy",
                        "torch's converter"),
    "pieces": FastPath("CKPTCTL_FAST_PIECES",
                       "DCP-HF and Megatron chunks copied by the kernel as byte ranges of their files",
                       "every tensor assembled and streamed in bounded windows"),
    "class-match": FastPath("CKPTCTL_FAST_CLASS_MATCH",
                            "verify's model-class check matching keys as transformers does, without its per-key "
                            "converter copies, and stacking fused experts from their shapes",
                            "transformers' own convert_and_load_state_dict_in_model"),
    "index-worker": FastPath("CKPTCTL_FAST_INDEX_WORKER",
                             "a large index parsed by a forked worker (which hands back each shard's names, and "
                             "verify's config-rule facts of them) while the command decodes the headers ahead",
                             "the index parsed, and the facts worked out from the tensor table, in the command's "
                             "own process"),
    "exit": FastPath("CKPTCTL_FAST_EXIT", "the CLI's process ends after its exit handlers and a flush of its "
                     "output, without freeing the interpreter's objects (only this thread left, torch never "
                     "imported)", "sys.exit"),
}


def enabled(name: str) -> bool:
    """Whether the fast path ``name`` (a key of :data:`FAST_PATHS`) is on: unless its
    environment variable says ``0``."""
    return os.environ.get(FAST_PATHS[name].env, "1") != "0"
