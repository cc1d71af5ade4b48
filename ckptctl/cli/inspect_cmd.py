"""`ckptctl inspect PATH`.

No ``from __future__ import annotations`` (see ``verify_cmd``): Typer evaluates string
annotations of the command on every run."""

from typing import Annotated, Any, Optional

import typer

from ckptctl.cli._options import JsonOpt, KeyOpt, OnlyOpt, QuietOpt, VerboseOpt
from ckptctl.cli._output import JsonRows, Output, human_size

FOLLOW_STATE = ".ckptctl-follow"  # ckptctl/follow/state.py STATE_DIR, not imported: inspect stays light


def inspect(
    path: Annotated[str, typer.Argument(metavar="PATH", help="Checkpoint directory, weights file, or repo id in the local HF cache.")],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
    filter_: Annotated[Optional[str], typer.Option("--filter", metavar="GLOB", help="Only tensors whose name matches this glob.")] = None,
    only: OnlyOpt = None,
    key: KeyOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = 0,
    verbose: VerboseOpt = 0,
) -> None:
    """Show what a checkpoint holds: files, tensors, parameters, dtypes, config. Reads headers only.

    Examples:

    \b
      ckptctl inspect ./hf
      ckptctl inspect ./hf --filter 'model.layers.0.*'
      ckptctl inspect output/checkpoint-500 --only zero
      ckptctl inspect ./hf --json | jq .parameters
    """
    out = Output("inspect", json_mode=json_, quiet=quiet, verbose=verbose)
    with out.guard():
        from ckptctl.errors import UsageError
        from ckptctl.gcpause import paused
        from ckptctl.inspect import inspect_path
        from ckptctl.resolve import resolve

        if key is not None:
            from ckptctl.write.options import check_key

            check_key(key)
        where = resolve(path)
        if where.note:
            out.info(f"inspecting {where.note}")
        if _follow_root(where.path):  # a follower's DST_ROOT: what it published, lost, removed
            if tensors or filter_ or only or key:
                raise UsageError(f"{path} is a follower's DST_ROOT: --tensors, --filter, --only and --key apply "
                                 "to one export in it", f"inspect one export: ckptctl inspect {path}/<name>")
            from ckptctl.cli.follow_inspect import show

            return show(out, where.path, json_=json_)
        res = inspect_path(where.path, only=only, name_filter=filter_, key=key or None)
        if json_:
            # the tensor rows are encoded and written a chunk at a time, never one string
            doc = out.document(True, **res.to_dict(with_tensors=False))
            with paused():  # a tuple per row, none in a cycle: no collection needed while they stream
                out.emit_json(doc, rows=JsonRows("tensors", *res.tensors.columns()))
            return
        _render(out, res, show_tensors=tensors or bool(filter_), filtered=bool(filter_))


def _follow_root(path: Any) -> bool:
    import os

    state = os.path.join(path, FOLLOW_STATE)
    return os.path.isdir(state) and not os.path.islink(state)


def config_value(value: Any) -> str:
    """A config.json value as its file shows it to people: a list as ``a, b``, text unquoted, the
    rest as JSON (``true``, ``null``), never a Python repr."""
    import json

    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ", ".join(value)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _render(out: Output, res, *, show_tensors: bool, filtered: bool = False) -> None:
    from rich.table import Table  # only when rendering: keeps `--help` from importing it

    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("path", res.path)
    summary.add_row("format", res.format)
    for key, value in res.zero.items():  # a DeepSpeed ZeRO checkpoint
        summary.add_row(key, str(value))
    if res.megatron:  # a Megatron checkpoint: the iteration and the mapping the export applies
        mega = res.megatron
        summary.add_row("iteration", str(mega.get("iteration")))
        summary.add_row("mapping", f"{mega['mapping']} (Hugging Face names)" if mega.get("mapping")
                        else f"none, Megatron names: {mega.get('mapping_error')}")
    summary.add_row("tensors", f"{len(res.tensors):,}")
    summary.add_row("parameters", f"{res.parameters:,}")
    summary.add_row("tensor bytes", f"{res.total_bytes:,} ({human_size(res.total_bytes)})")
    for key, value in res.config.items():
        summary.add_row(key, config_value(value))
    out.print(summary)

    _render_state(out, res)
    dtypes = _table("dtypes", ("dtype", "tensors", "parameters", "bytes"), left=("dtype",))
    for name, d in res.dtypes.items():
        dtypes.add_row(name, f"{d['tensors']:,}", f"{d['parameters']:,}", human_size(d["bytes"]))
    out.print(dtypes)

    if res.components:
        comps = _table("components", ("component", "folder", "class", "format", "tensors", "parameters"),
                       left=("component", "folder", "class", "format"))
        for c in res.components:
            comps.add_row(c.name, c.path or ".", c.cls or "?", c.format, f"{c.tensors:,}", f"{c.parameters:,}")
        out.print(comps)

    files = _table("files", ("file", "role", "size", "tensors", "parameters"), left=("file", "role"))
    shard_rows = {s["name"]: s for s in res.shards()}
    for f in res.files:
        s = shard_rows.get(f["name"])
        if filtered and s is not None and not s["tensors"]:
            continue  # --filter: the shards that hold a matching tensor
        files.add_row(f["name"], f["role"], human_size(f["size"]) if f["size"] is not None else "?",
                      f"{s['tensors']:,}" if s else "", f"{s['parameters']:,}" if s else "")
    out.print(files)

    if show_tensors:
        t = _table("tensors", ("name", "dtype", "shape", "parameters", "file"), left=("name", "dtype", "shape", "file"))
        for row in res.tensors:
            t.add_row(row.name, row.dtype, str(list(row.shape)), f"{row.parameters:,}", row.file)
        out.print(t)
    for f in res.findings:
        out.warn(f"{f.message} [{f.code}]")


def _table(title: str, columns: tuple[str, ...], *, left: tuple[str, ...]) -> Any:
    """A titled rich table: the ``left`` columns left-justified, the others (counts) right."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right")
    return t


def _render_state(out: Output, res) -> None:
    """The Megatron arguments, or a DCP training state's top-level keys (``--key`` picks one)."""
    args = (res.megatron or {}).get("args") or {}
    if args:
        t = _table("megatron arguments", ("argument", "value"), left=("argument", "value"))
        for k, v in args.items():
            t.add_row(k, str(v))
        out.print(t)
    if res.state_keys:
        t = _table("training state (pass --key KEY to list a key's tensors)",
                   ("key", "tensors", "parameters", "size", "dtypes", "other entries"), left=("key", "dtypes"))
        for row in res.state_keys:
            t.add_row(row["key"], f"{row['tensors']:,}", f"{row['parameters']:,}", human_size(row["bytes"]),
                      ", ".join(f"{d} x{n}" for d, n in row["dtypes"].items()), f"{row['objects']:,}")
        out.print(t)
