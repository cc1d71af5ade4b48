"""What ``inspect`` shows for each located source kind (``sources/kinds.py``): the tensors its
export would write, where they are stored, and what its framework recorded. Each function is a
kind's ``inspect`` hook: ``(location, path, *, only, name_filter, key, reading) -> Inspection``
(None: the layout reads the path instead)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckptctl.config_fields import read_config
from ckptctl.inspect import Inspection, config_summary
from ckptctl.sources.base import key_refused


def inspect_zero(loc: Any, p: Path, *, name_filter: str | None = None, key: str | None = None,
                 **_: Any) -> Inspection:
    """A DeepSpeed ZeRO root or step folder: its fp32 master weights (the ZeRO source's), stage,
    world size and rank files."""
    from ckptctl.sources.zero.source import open_location

    with open_location(loc, p, key=key) as src:
        ck = src.checkpoint
        assert ck is not None
        info = ck.describe()
        res = Inspection(path=str(p), format=f"deepspeed-zero{ck.stage}", kind=src.kind, aliases=dict(src.aliases),
                         zero={k: info[k] for k in ("stage", "world_size", "tag", "ds_version")})
        for f in [*ck.files, *src.extras]:
            role = "optimizer-states" if f in ck.files[:ck.world] else "model-states" if f in ck.files else "extra"
            res.files.append({"name": os.path.relpath(f, p), "size": f.stat().st_size, "role": role})
        for t in src.tensors:  # a tensor split over the ranks' files is in "<tag>/*"
            res.tensors.add(t.spec, f"{ck.loc.tag}/{Path(t.file).name if t.file else '*'}", None)
    res.tensors.arrange(by_component=False, name_filter=name_filter)
    cfg = read_config(ck.loc.root)
    if cfg is not None:
        res.config = config_summary(cfg)
    return res


def inspect_megatron(loc: Any, p: Path, *, name_filter: str | None = None, key: str | None = None,
                     **_: Any) -> Inspection:
    """A Megatron torch_dist checkpoint: the tensors the export would write (the mapping's HF
    names, or Megatron's when no mapping applies, saying why), the arguments and the config."""
    from ckptctl.sources.megatron.source import MegatronSource

    if key:
        raise key_refused(p, "Megatron-core", key, "the model's tensors are read (the optimizer state is left out)")
    with MegatronSource.open_location(loc, fallback=True) as src:
        res = Inspection(path=str(p), format="megatron-torch_dist", kind=src.kind, megatron=src.describe())
        for f in sorted(os.listdir(loc.folder)):
            role = "weights" if f.endswith(".distcp") else "metadata" if f.startswith((".", "metadata")) else "extra"
            try:
                size: int | None = os.lstat(loc.folder / f).st_size  # a link is listed as itself, never followed
            except OSError:
                size = None  # gone since the listing
            res.files.append({"name": os.path.relpath(loc.folder / f, p), "size": size, "role": role})
        for t in src.tensors:
            res.tensors.add(t.spec, src.place(t, p), None)
    res.tensors.arrange(by_component=False, name_filter=name_filter)
    res.config = config_summary(src.config) if src.config else {}
    return res


def inspect_dcp_hf(found: Any, p: Path, *, only: str | None = None, name_filter: str | None = None,
                   key: str | None = None, reading: Any = None, **_: Any) -> Inspection | None:
    """torch's DCP-HF sharded save: the global tensors its shards make up (None when the root's
    consolidated files hold the same tensors: the layout shows those)."""
    from ckptctl.sources.dcp.hf import open_location

    src = open_location(found, p, only=only, key=key, reading=reading)
    if src is None:
        return None
    res = Inspection(path=str(p), format=src.kind, kind=src.kind)
    with src:
        res.files.extend(src.file_rows(p))
        for t in src.tensors:
            res.tensors.add(t.spec, src.place(t, p), None)
    res.tensors.arrange(by_component=False, name_filter=name_filter)
    cfg = read_config(p) if p.is_dir() else None
    if cfg is not None:
        res.config = config_summary(cfg)
    return res
