"""What a checkpoint holds, as data: files, tensors, parameters, dtypes and config fields.

Safetensors checkpoints are described from their headers alone (no tensor data is read, torch is
not imported). Pickles and DCP checkpoints need torch to read their metadata.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from math import prod
from pathlib import Path
from typing import Any

from ckptctl import layout as L
from ckptctl.config_fields import ConfigFields
from ckptctl.errors import InputError
from ckptctl.findings import Finding
from ckptctl.format import dtypes as dt
from ckptctl.format import small
from ckptctl.format.header import load_header
from ckptctl.format.tensor import SpecFields, TensorSpec

CONFIG_FIELDS = (
    "model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "dtype", "tie_word_embeddings",
)


@dataclass
class TensorRow(SpecFields):
    spec: TensorSpec
    file: str  # relative to the inspected root (``unet/diffusion_pytorch_model.safetensors``)
    component: str | None = None  # the component of a multi-component root

    @property
    def parameters(self) -> int:
        return self.spec.numel


@dataclass
class ComponentRow:
    name: str
    path: str
    cls: str | None
    format: str  # the component's weights format, or "none" (a scheduler, a tokenizer, pooling)
    tensors: int = 0
    parameters: int = 0
    total_bytes: int = 0


@dataclass
class Inspection:
    path: str
    format: str
    files: list[dict[str, Any]] = field(default_factory=list)
    tensors: list[TensorRow] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    components: list[ComponentRow] = field(default_factory=list)

    @property
    def parameters(self) -> int:
        """Elements of the tensors stored in the files, each stored tensor once: a tied weight
        stored once counts once (as the library counts it); a buffer the library saves (a bias
        table, a router correction) counts, a parameter it recomputes and does not save (sinusoidal
        positions) does not. A multi-component root sums its components."""
        return self._totals()[0]

    @property
    def total_bytes(self) -> int:
        return self._totals()[1]

    @property
    def dtypes(self) -> dict[str, dict[str, int]]:
        return self._totals()[2]

    def _totals(self) -> tuple[int, int, dict[str, dict[str, int]]]:
        """Parameters, bytes and the per-dtype totals, in one pass over the tensors (each tensor's
        element count is computed once: at 90k tensors the properties' chains were most of it)."""
        return _tally(self.tensors)[:3]

    def shards(self) -> list[dict[str, Any]]:
        by: dict[str, dict[str, Any]] = {}
        for f in self.files:
            if f["role"] == "weights":
                by[f["name"]] = {"name": f["name"], "size": f["size"], "tensors": 0, "parameters": 0}
        for t in self.tensors:
            if t.file in by:
                by[t.file]["tensors"] += 1
                by[t.file]["parameters"] += t.parameters
        return list(by.values())

    def to_dict(self, *, with_tensors: bool = True) -> dict[str, Any]:
        parameters, total_bytes, dtypes, rows = _tally(self.tensors, with_rows=with_tensors)
        doc: dict[str, Any] = {
            "path": self.path,
            "format": self.format,
            "files": self.files,
            "tensor_count": len(self.tensors),
            "parameters": parameters,
            "total_bytes": total_bytes,
            "dtypes": dtypes,
            "config": self.config,
            "findings": [f.to_dict() for f in self.findings],
        }
        if self.aliases:
            doc["aliases"] = self.aliases
        if self.components:
            doc["components"] = [vars(c) for c in self.components]
        if with_tensors:
            doc["tensors"] = rows
        return doc


def _tally(tensors: list[TensorRow], *, with_rows: bool = False
           ) -> tuple[int, int, dict[str, dict[str, int]], list[dict[str, Any]]]:
    """Total parameters, total bytes, per-dtype totals (sorted by dtype) and, with ``with_rows``,
    each tensor's JSON row: one pass, each tensor's size computed once."""
    parameters = total = 0
    by_dtype: dict[str, dict[str, int]] = {}
    bits: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    for t in tensors:
        spec = t.spec
        dtype = spec.dtype
        n = prod(spec.shape)
        b = bits.get(dtype)  # type: ignore[arg-type]
        if b is None:
            b = bits[dtype] = dt.BY_NAME[dtype].bits  # type: ignore[index]
        nbytes = n * b // 8  # = TensorSpec.nbytes
        parameters += n
        total += nbytes
        d = by_dtype.get(dtype)  # type: ignore[arg-type]
        if d is None:
            d = by_dtype[dtype] = {"tensors": 0, "parameters": 0, "bytes": 0}  # type: ignore[index]
        d["tensors"] += 1
        d["parameters"] += n
        d["bytes"] += nbytes
        if with_rows:
            row = {"name": spec.name, "dtype": dtype, "shape": list(spec.shape), "parameters": n,
                   "bytes": nbytes, "file": t.file}
            if t.component is not None:
                row["component"] = t.component
            rows.append(row)
    return parameters, total, dict(sorted(by_dtype.items())), rows


def config_summary(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config fields that matter, under their Llama-style names (``config_fields`` knows the
    other names and the nested ``text_config``)."""
    return ConfigFields(cfg).summary(CONFIG_FIELDS)


def read_config(root: Path) -> dict[str, Any] | None:
    """config.json as a dict, or None when it is missing, unreadable or not a JSON object."""
    try:
        cfg = small.read_json(root / "config.json", follow=True)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def inspect_path(path: str | os.PathLike[str], *, only: str | None = None,
                 name_filter: str | None = None, key: str | None = None) -> Inspection:
    """Describe the checkpoint at ``path``; a multi-component root (diffusers pipeline,
    sentence-transformers model) is described component by component. ``key`` selects the
    state dict of a pickle or DCP source that holds several (a training state is refused
    without it, with the keys to choose from)."""
    p = Path(path)
    lay = L.scan(p)
    if not lay.components:
        fam = lay.primary(only) if lay.families else None
        if fam is None:
            raise InputError(f"{p} holds no checkpoint weights", "pass a checkpoint directory or a weights file")
        res = Inspection(path=str(p), format=_format(fam), findings=list(lay.findings))
        _add_family(res, p, lay, fam, only=only, key=key)
    else:
        res = Inspection(path=str(p), format=lay.kind, findings=list(lay.findings))
        for comp in lay.components:
            sub = lay if comp.path == "" else comp.layout
            fam = sub.primary(only) if sub is not None and sub.families else None
            row = ComponentRow(comp.name, comp.path, comp.cls, _format(fam) if fam else "none")
            res.components.append(row)
            if fam is None:
                continue
            if sub is not lay:
                res.findings.extend(sub.findings)
            before = len(res.tensors)
            _add_family(res, sub.root, sub, fam, only=only, component=comp.name, prefix=comp.path)
            added = res.tensors[before:]
            row.tensors = len(added)
            row.parameters = sum(t.parameters for t in added)
            row.total_bytes = sum(t.nbytes for t in added)
    if res.components:
        res.tensors.sort(key=lambda t: (t.component or "", t.spec.name))
    else:  # no component: the same order by name alone (the sort is stable, names are unique per family)
        res.tensors.sort(key=lambda t: t.spec.name)
    if name_filter:
        res.tensors = [t for t in res.tensors if fnmatchcase(t.name, name_filter)]
    cfg = read_config(lay.root) if lay.single_file is None else None
    if cfg is not None and isinstance(cfg, dict):
        res.config = config_summary(cfg)
    return res


def _format(fam: L.Family) -> str:
    if fam.kind == L.SAFETENSORS:
        return "safetensors-sharded" if fam.index else "safetensors"
    return fam.kind


def _add_family(res: Inspection, p: Path, lay: L.Layout, fam: L.Family, *, only: str | None,
                component: str | None = None, prefix: str = "", key: str | None = None) -> None:
    """Add a family's files and tensors to ``res``; names are relative to the inspected root."""
    def rel(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    def file_row(name: str, role: str) -> dict[str, Any]:
        try:
            size = (lay.root / name).stat().st_size
        except OSError:
            size = None
        return {"name": rel(name), "size": size, "role": role}

    for n in fam.files:
        res.files.append(file_row(n, "weights"))
    if fam.index:
        res.files.append(file_row(fam.index, "index"))
    if lay.single_file is None:
        for other in lay.variants:  # another variant beside the family read: listed, not counted
            if other is not fam:
                res.files.extend(file_row(n, "variant") for n in other.all_files)
        for n in lay.extras:
            res.files.append(file_row(n, "extra"))
        for n in lay.leftovers:
            res.files.append(file_row(n, "leftover"))

    if fam.container == L.SAFETENSORS:
        for n in fam.files:
            hdr = load_header(lay.root / n, display=str(lay.root / n))
            for t in hdr.tensors.values():
                res.tensors.append(TensorRow(t.spec, rel(n), component))
    else:
        from ckptctl.sources import open_source

        with open_source(p, only=only, key=key) as src:
            res.aliases.update(src.aliases)
            for t in src.tensors:
                where = Path(t.file).name if t.file else _pickle_file(fam)
                res.tensors.append(TensorRow(t.spec, rel(where), component))


def _pickle_file(fam: L.Family) -> str:
    """Which pickle a tensor came from (sharded pickles are not told apart: "*")."""
    return fam.files[0] if len(fam.files) == 1 else "*"
