"""`ckptctl export SRC DST`.

No ``from __future__ import annotations`` (see ``verify_cmd``): Typer evaluates string
annotations of the command on every run."""

import os
import sys
from contextlib import contextmanager
from typing import Annotated, Iterator, Optional

import typer

from ckptctl.cli._options import (DryRunOpt, DtypeOpt, JsonOpt, KeyOpt, LabelOpt, ManifestOpt, NameSet, NoFsyncOpt,
                                  OnlyOpt, QuietOpt, TimeoutOpt, VerboseOpt)
from ckptctl.cli._output import Output, ProgressReporter, human_size, names_line
from ckptctl.cli.follow_cmd import (ExitWhenIdleOpt, FollowOpt, FromOpt, KeepBestOpt, KeepEveryOpt, KeepLastOpt,
                                    OnceOpt, OnPublishOpt, OnPublishTimeoutOpt, PollOpt, PriorityOpt, QuietPeriodOpt,
                                    VerifyOpt, refuse_follow_only)

def export(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Source: safetensors file/dir, .bin/.pt, PEFT adapter dir, DCP dir, DeepSpeed ZeRO or Megatron torch_dist checkpoint, or a cached repo id.")],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Destination directory (published atomically).")],
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", metavar="SIZE", help="Shard size limit: 5GB (decimal, as huggingface_hub) or 2GiB.")] = "5GB",
    dtype: DtypeOpt = "keep",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing destination atomically.")] = False,
    manifest: ManifestOpt = False,
    label: LabelOpt = None,
    key: KeyOpt = None,
    only: OnlyOpt = None,
    names: Annotated[Optional[NameSet], typer.Option("--names", show_default=False, help="Tensor names to write: hf (default; a Megatron checkpoint is mapped to its HF family) or megatron (Megatron's own, unmapped).")] = None,
    vocab_size: Annotated[Optional[int], typer.Option("--vocab-size", metavar="N", help="Megatron: keep the first N rows of the embedding and output layer (when the arguments do not give the tokenizer's size).")] = None,
    config: Annotated[Optional[str], typer.Option("--config", metavar="CONFIG_JSON", help="Megatron: the model's Hugging Face config.json, for a checkpoint without its arguments (checked against the tensors, published as given).")] = None,
    no_mtp: Annotated[bool, typer.Option("--no-mtp", help="Megatron: leave the multi-token-prediction (MTP) layers out on purpose.")] = False,
    no_fsync: NoFsyncOpt = False,
    timeout: TimeoutOpt = 300.0,
    dry_run: DryRunOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = 0,
    verbose: VerboseOpt = 0,
    follow: FollowOpt = False,
    once: OnceOpt = False,
    start_from: FromOpt = None,
    quiet_period: QuietPeriodOpt = None,
    poll_interval: PollOpt = None,
    exit_when_idle: ExitWhenIdleOpt = None,
    keep_last: KeepLastOpt = None,
    keep_every: KeepEveryOpt = None,
    keep_best: KeepBestOpt = None,
    verify: VerifyOpt = False,
    on_publish: OnPublishOpt = None,
    on_publish_timeout: OnPublishTimeoutOpt = None,
    priority: PriorityOpt = None,
) -> None:
    """Write a checkpoint as HF safetensors shards + index + config/tokenizer files, atomically.

    Examples:

    \b
      ckptctl export ./step_1000 ./hf/step_1000 --max-shard-size 5GB
      ckptctl export ./checkpoint.pt ./hf --key state_dict --dtype bf16 --overwrite
      ckptctl export output/checkpoint-500 ./hf --dtype bf16     # HF Trainer + DeepSpeed ZeRO
      ckptctl export /ckpts/run1 ./hf                            # Megatron-core torch_dist
      ckptctl export meta-llama/Llama-3.2-1B ./local --dry-run   # a repo id in the local HF cache
      ckptctl export ./run ./exports --follow --keep-last 3      # every save of a training job
    """
    if follow:  # SRC is a training job's output: every completed save (cli/follow_cmd.py, docs/FOLLOW.md)
        from ckptctl.cli.follow_cmd import run_follow

        return run_follow(src, dst, json_=json_, quiet=quiet, verbose=verbose, **{
            k: v for k, v in locals().items() if k not in ("src", "dst", "json_", "quiet", "verbose", "follow")})
    out = Output("export", json_mode=json_, quiet=quiet + (1 if json_ else 0), verbose=verbose)
    with out.guard():
        refuse_follow_only(locals())
    multi_rank = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        _run(out, src, dst, max_shard_size, dtype, overwrite, manifest, label, key, only, no_fsync, timeout,
             dry_run, json_, multi_rank, names, vocab_size, no_mtp, config)
    except typer.Exit as done:
        if multi_rank and done.exit_code:
            _leave(done.exit_code)
        raise


def _leave(code: int) -> None:
    """End a failed or interrupted rank now: an exchange it left unfinished is Gloo work that torch
    would wait for at exit (up to the timeout). Its cleanup ran and its error was reported."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run(out, src, dst, max_shard_size, dtype, overwrite, manifest, label, key, only, no_fsync, timeout, dry_run,
         json_, multi_rank, names=None, vocab_size=None, no_mtp=False, config=None) -> None:
    with out.guard():
        from ckptctl.api import export as run_export
        from ckptctl.errors import UsageError
        from ckptctl.resolve import resolve
        from ckptctl.write.options import ExportOptions

        if not timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, not {timeout:g}", "e.g. --timeout 300")
        if label and not manifest:
            out.warn("--label is recorded only in the manifest; add --manifest")
        reporter = ProgressReporter(out, waiting=f"preparing the {dtype} conversion" if dtype not in (None, "keep")
                                    else "preparing the write")
        opts = ExportOptions(max_shard_size=max_shard_size, dtype=dtype, overwrite=overwrite, fsync=not no_fsync,
                             manifest=manifest, label=label, dry_run=dry_run, progress=reporter, names=names,
                             vocab_size=vocab_size, no_mtp=no_mtp, config=config,
                             command=None)  # the owner record takes this process's real command line
        where = resolve(src)
        if where.note:
            out.info(f"exporting {where.note}")
        try:
            reporter.start()  # a status line until the plan is made (a terminal only)
            if multi_rank:
                result, rank, group = _export_under_torchrun(where.path, dst, opts, key, only, timeout)
            else:
                result, rank, group = run_export(where.path, dst, opts, key=key, only=only), 0, None
            with _completed(result):  # a signal from here on comes after the publish
                reporter.close()
                if group is not None:
                    group.destroy_process_group()
                if rank != 0:
                    return  # rank 0 reports for everyone
                if json_:
                    out.emit_json(out.document(True, **result.to_dict()))
                    return
                for note in result.notes:
                    out.note(note)
                render_result(out, result)
        finally:
            reporter.close()


@contextmanager
def _completed(result) -> Iterator[None]:
    """Ctrl-C (or SIGTERM/SIGHUP) after the export returned: say what is true, it is published."""
    from ckptctl.errors import Interrupted

    try:
        yield
    except KeyboardInterrupt:
        if result.dry_run:
            raise Interrupted("interrupted after the dry run; nothing was changed", "nothing to undo") from None
        raise Interrupted(f"interrupted after the export completed: {result.dest} holds the new version",
                          "nothing to redo", phase="report") from None


def _export_under_torchrun(src, dst, opts, key, only, timeout):
    """torchrun --nproc-per-node N -m ckptctl export SRC DST: ranks split the shards. Joining and
    every exchange wait at most ``timeout`` seconds for the other ranks. Returns the result, this
    rank, and ``torch.distributed`` when this call created the process group (else None)."""
    # one error line and its hint, not the socket warnings and errors torch logs on the way (CKPTCTL_DEBUG shows them)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "WARNING" if os.environ.get("CKPTCTL_DEBUG") else "FATAL")
    import torch.distributed as dist

    from ckptctl.distributed import export_distributed, init_from_env

    owned = not dist.is_initialized()
    if owned:
        init_from_env(timeout)
    rank = dist.get_rank()
    if rank != 0:
        opts.progress = None
    result = export_distributed(src, dst, opts, key=key, only=only, timeout=timeout)
    # the caller tears the group down; after a failure the process ends at once (_leave) instead
    return result, rank, dist if owned else None


def render_result(out: Output, result) -> None:
    if hasattr(result, "components"):  # a multi-component root (write/tree.py RootResult)
        render_root(out, result)
        return
    verb = "would write" if result.dry_run else "wrote"
    out.print(f"{verb} {result.dest}")  # its own line: a long path is never wrapped to the table's width
    out.table(_FILE_COLUMNS, _file_rows(result))
    space = f" ({human_size(result.space_available)} free)" if result.space_available is not None else ""
    size = f"{human_size(result.bytes_to_write)} to write{space}" if result.dry_run else \
        f"{human_size(result.bytes_to_write)} written"
    lines = [f"{result.tensors:,} tensors, {result.parameters:,} parameters, {size}"]
    if result.converted:
        lines.append(f"{result.converted:,} tensors converted")
    if result.aliases:
        lines.append("tied tensors stored once: " + ", ".join(f"{k} -> {v}" for k, v in sorted(result.aliases.items())))
    if result.removed:
        lines.append(names_line(("would remove" if result.dry_run else "removed") + " from the old version",
                                result.removed))
    if result.carried:
        lines.append(names_line("would keep" if result.dry_run else "kept", result.carried))
    if result.recovered:
        lines.append("recovered an interrupted publish: " + "; ".join(result.recovered))
    if not result.dry_run:
        how = [f"{human_size(n)} {what}" for n, what in (
            (result.bytes_cloned, "cloned (shared with the source)"),
            (result.bytes_copied_by_kernel, "copied by the kernel"), (result.bytes_streamed, "streamed")) if n]
        if how:  # only what happened: no "0 bytes cloned" where the filesystem cannot clone
            lines.append(", ".join(how))
        lines.append(f"published by {result.publish} in {result.seconds:.2f}s")
    for line in lines:
        out.print(line)


_FILE_COLUMNS = (("file", "left"), ("size", "right"), ("tensors", "right"))


def _file_rows(result, folder: str = "") -> list[tuple[str, str, str]]:
    """One row per file an export writes (``folder/`` before each name for a root's component)."""
    rows = [(folder + f["name"], human_size(f["size"]), f"{f['tensors']:,}") for f in result.files]
    rows += [(folder + name, "", "") for name in ([result.index] if result.index else []) + result.extras
             + result.variants]
    return rows


def render_root(out: Output, result) -> None:
    """A multi-component root: each component's files under its folder, then the root's summary."""
    verb = "would write" if result.dry_run else "wrote"
    out.print(f"{verb} {result.dest} ({result.kind} root)")
    out.table(_FILE_COLUMNS, [row for folder, res in sorted(result.exports.items())
                              for row in _file_rows(res, f"{folder}/" if folder else "")])
    lines = [f"{len(result.components)} components with weights, {result.tensors:,} tensors, "
             f"{result.parameters:,} parameters"]
    if result.copied:
        lines.append(names_line(("would copy" if result.dry_run else "copied") + " from the root", result.copied))
    if result.removed:
        lines.append(names_line(("would remove" if result.dry_run else "removed") + " from the old version",
                                result.removed))
    if result.kept:
        lines.append(names_line("would keep" if result.dry_run else "kept", result.kept))
    if result.recovered:
        lines.append("recovered an interrupted publish: " + "; ".join(result.recovered))
    if not result.dry_run:
        lines.append(f"published by {result.publish} in {result.seconds:.2f}s")
    for line in lines:
        out.print(line)
