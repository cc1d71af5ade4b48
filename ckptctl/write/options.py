"""What an export is asked to do: the options as given, and the same options validated.

:class:`ExportOptions` is the public input (library keywords, CLI flags). :func:`validate` turns
it into :class:`ExportSettings` (the shard size in bytes, the target dtype, ``only``/``key``).
Every way into the writer calls it first, before anything touches the filesystem: a bad
``--max-shard-size`` or ``--dtype`` never lets a recovery rename a directory or a source be
opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ckptctl.errors import UsageError
from ckptctl.format import dtypes as dt
from ckptctl.format import names as N
from ckptctl.sizes import CHUNK_BYTES, parse_size
from ckptctl.sources.kinds import NAMES_CHOICES, ONLY_CHOICES

DEFAULT_MAX_SHARD_SIZE = "5GB"
KEEP = "keep"  # --max-shard-size keep: one output shard per source file, same tensors


@dataclass
class ProgressEvent:
    """One step of a write, for a progress display."""

    phase: str  # plan | write | shard-done | finalize | publish | done
    file: str | None = None
    done: int = 0
    total: int = 0
    message: str | None = None


ProgressFn = Callable[[ProgressEvent], None]


@dataclass
class ExportOptions:
    """How to write a checkpoint: shard size, dtype, overwrite, durability, manifest and more."""

    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE  # None: the default
    dtype: str | None = None  # keep | bf16 | fp16 | fp32 (None = keep)
    overwrite: bool = False
    fsync: bool = True
    manifest: bool = False
    label: str | None = None
    dry_run: bool = False
    metadata: dict[str, str] | None = None
    prefix: str = "model"  # the library stem the files are named after; a source's own stem wins
    variant: str | None = None  # model.<variant>.safetensors; a variant source is written as that variant
    single_file: bool = False  # adapters: always one file
    command: str | None = None
    progress: ProgressFn | None = None
    chunk_bytes: int = CHUNK_BYTES
    names: str | None = None  # hf (None) | megatron: see NAMES_CHOICES
    vocab_size: int | None = None  # --vocab-size: the rows of a Megatron embedding and head kept
    no_mtp: bool = False  # --no-mtp: a Megatron checkpoint's MTP layers left out on purpose
    config: str | None = None  # --config: the HF config.json a Megatron checkpoint without arguments maps to
    # A planned shard whose bytes already exist (``ShardPlan.link_from``): hard-linked, or with
    # False an independent copy (cloned where the filesystem can, else copied by the kernel).
    link_unchanged: bool = True


@dataclass(frozen=True)
class ExportSettings:
    """The options an export acts on, validated."""

    max_shard_size: int  # bytes
    target_dtype: str | None  # safetensors dtype floating tensors are stored as; None: as they are
    only: str | None = None
    key: str | None = None
    keep_layout: bool = False  # --max-shard-size keep: the source's own shards
    names: str | None = None  # --names megatron: a Megatron checkpoint's own names (the opener's ``names``)
    source_options: tuple[tuple[str, object], ...] = ()  # given to the source kind's opener (--vocab-size)


def target_dtype(option: str | None) -> str | None:
    """The safetensors dtype a ``--dtype`` value converts to (None for keep)."""
    if option in (None, "", "keep"):
        return None
    try:
        return dt.TARGETS[option]  # type: ignore[index]
    except KeyError:
        raise UsageError(f"unknown --dtype {option!r}", "use keep, bf16, fp16 or fp32") from None


def check_key(key: str | None) -> None:
    """A ``--key`` (dotted path to a nested state dict) must have no empty part."""
    if key is not None and key != "" and "" in key.split("."):
        raise UsageError(f"--key {key!r} has an empty part", "use a dotted key such as state_dict or model.module")


def validate(opts: ExportOptions, *, only: str | None = None, key: str | None = None) -> ExportSettings:
    """Check every option; raises :class:`UsageError` (exit 2). Touches no file."""
    keep = isinstance(opts.max_shard_size, str) and opts.max_shard_size.strip().lower() == KEEP
    try:
        size = parse_size(DEFAULT_MAX_SHARD_SIZE if opts.max_shard_size is None or keep else opts.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc), "use a size like 5GB, 500MB or 2GiB, or keep") from None
    target = target_dtype(opts.dtype)
    if only is not None and only not in ONLY_CHOICES:
        raise UsageError(f"unknown --only {only!r}", f"use one of {', '.join(ONLY_CHOICES)}")
    if opts.names not in (None, "", *NAMES_CHOICES):
        raise UsageError(f"unknown --names {opts.names!r}", f"use one of {', '.join(NAMES_CHOICES)}")
    if opts.names == "megatron":
        if only not in (None, "megatron"):
            raise UsageError(f"--names megatron reads a Megatron checkpoint, not --only {only}",
                             "drop --only, or use --only megatron")
    check_key(key)
    if opts.vocab_size is not None and (type(opts.vocab_size) is not int or opts.vocab_size <= 0):
        raise UsageError(f"--vocab-size {opts.vocab_size!r} is not a positive integer", "e.g. --vocab-size 151936")
    if opts.prefix in ("", ".", "..") or "/" in opts.prefix or "\0" in opts.prefix:
        raise UsageError(f"file name prefix {opts.prefix!r} is not a plain name", "use a name such as model")
    parsed = N.parse_weights_name(f"model.{opts.variant}.safetensors") if opts.variant is not None else None
    if opts.variant is not None and (parsed is None or parsed.variant != opts.variant):
        raise UsageError(f"variant {opts.variant!r} is not a plain variant name", "use a name such as fp16")
    source_options = ((("vocab_size", opts.vocab_size),) if opts.vocab_size is not None else ()) + (
        (("no_mtp", True),) if opts.no_mtp else ()) + ((("config", str(opts.config)),) if opts.config else ())
    return ExportSettings(size, target, only, key or None, keep_layout=keep, names=opts.names or None,
                          source_options=source_options)
