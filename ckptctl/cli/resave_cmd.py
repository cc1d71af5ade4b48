"""`ckptctl resave DIR`.

No ``from __future__ import annotations`` (see ``verify_cmd``): Typer evaluates string
annotations of the command on every run."""

from typing import Annotated, Optional

import typer

from ckptctl.cli._options import (DryRunOpt, DtypeOpt, JsonOpt, LabelOpt, ManifestOpt, NoFsyncOpt, QuietOpt,
                                  VerboseOpt)
from ckptctl.cli._output import Output, ProgressReporter, names_line, plural

def resave(
    directory: Annotated[str, typer.Argument(metavar="DIR", help="Checkpoint directory to rewrite in place.")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="OUT", help="Write the result here instead of replacing DIR.")] = None,
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", metavar="SIZE", help="Re-shard: 5GB (decimal) or 2GiB.")] = None,
    dtype: DtypeOpt = "keep",
    repair: Annotated[bool, typer.Option("--repair", help="Fix what verify finds when the fix is certain.")] = False,
    prefer: Annotated[Optional[str], typer.Option("--prefer", metavar="FAMILY|FILE", help="Which family to keep when two are complete: index, single, safetensors, pytorch, or a file of the family (e.g. model-00001-of-00002.safetensors), as the refusal lists them.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="With --output: replace an existing OUT.")] = False,
    static: Annotated[bool, typer.Option("--static", help="With --repair: verify with the static rules only, as `verify --static` (no model-class check: torch and transformers are not imported).")] = False,
    link: Annotated[bool, typer.Option("--link", help="With --output: hard-link unchanged shards instead of cloning or copying them (OUT then shares inodes with DIR).")] = False,
    manifest: ManifestOpt = False,
    label: LabelOpt = None,
    no_fsync: NoFsyncOpt = False,
    dry_run: DryRunOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = 0,
    verbose: VerboseOpt = 0,
) -> None:
    """Re-shard, change dtype, or repair a checkpoint in place, atomically, copying nothing that did not change.

    --dtype alone keeps the shard layout; --max-shard-size re-plans it.

    Examples:

    \b
      ckptctl resave ./hf --dtype bf16                    # same shards, half the bytes
      ckptctl resave ./hf --max-shard-size 2GB
      ckptctl resave ./hf --repair --dry-run              # what would be fixed
      ckptctl resave ./hf --repair --static -o ./fixed    # cron-safe: no torch import
    """
    out = Output("resave", json_mode=json_, quiet=quiet + (1 if json_ else 0), verbose=verbose)
    with out.guard():
        from ckptctl.resave import ResaveResult
        from ckptctl.resave import resave as run_resave
        from ckptctl.write.options import ExportOptions

        if static and not repair:
            from ckptctl.errors import UsageError

            raise UsageError("--static applies to --repair (the only resave that runs verify)",
                             "add --repair, or drop --static")
        before = _shards(directory)
        reporter = ProgressReporter(out, waiting=f"preparing the {dtype} conversion" if dtype not in (None, "keep")
                                    else "preparing the write")
        opts = ExportOptions(max_shard_size=max_shard_size, dtype=dtype, overwrite=overwrite, fsync=not no_fsync,
                             manifest=manifest, label=label, dry_run=dry_run, progress=reporter,
                             command=None)  # the owner record takes this process's real command line
        try:
            reporter.start("reading the checkpoint and planning")
            result = run_resave(directory, opts, output=output, repair=repair, prefer=prefer, link=link,
                                static=static)
        finally:
            reporter.close()
        if json_:
            out.emit_json(out.document(True, **result.to_dict()))
            return
        if isinstance(result, ResaveResult) and not result.unchanged:
            after = sorted(f["name"] for f in result.export.files)
            if before and after != before:
                out.info(f"layout changed: {plural(len(before), 'shard')} -> {plural(len(after), 'shard')}"
                         + ("" if max_shard_size else " (pass --max-shard-size to choose the size)"))
        if result.unchanged:
            out.print(f"nothing to repair: {directory} is sound; nothing was written")
            return
        if not isinstance(result, ResaveResult):  # a multi-component root (RootResult)
            for folder, res in sorted(result.components.items()):
                for fix in res.repair.fixes:
                    out.print(("to fix: " if dry_run else "fixed: ") + f"{folder or '.'}: {fix}")
            from ckptctl.cli.export_cmd import render_root  # (a command module: only for what it renders)

            render_root(out, result)
            return
        for fix in result.repair.fixes:
            out.print(("to fix: " if dry_run else "fixed: ") + fix)
        from ckptctl.cli.export_cmd import render_result

        render_result(out, result.export)
        if result.export.linked:
            out.print(names_line("would link unchanged" if dry_run else "linked unchanged", result.export.linked))


def _shards(directory: str) -> list[str]:
    """The safetensors files DIR holds now (what a changed layout is compared with)."""
    import os

    try:
        return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    except OSError:
        return []
