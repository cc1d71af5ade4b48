"""What a checkpoint holds, as data: files, tensors, parameters, dtypes and config fields.

Safetensors checkpoints are described from their headers alone (no tensor data is read, torch is
not imported). Pickles and DCP checkpoints need torch to read their metadata.
"""

from __future__ import annotations

import fnmatch
import operator
import os
import re
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from math import prod
from pathlib import Path
from typing import Any, overload

from ckptctl import layout as L
from ckptctl.config_fields import ConfigFields, read_config
from ckptctl.errors import InputError
from ckptctl.findings import Finding
from ckptctl.format import dtypes as dt
from ckptctl.format.header import TensorTable
from ckptctl.format.tensor import SpecFields, TensorSpec
from ckptctl.gcpause import paused
from ckptctl.layout.version import one_version

CONFIG_FIELDS = (
    "model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "dtype", "tie_word_embeddings",
)


@dataclass
class TensorRow(SpecFields):
    """One tensor as inspect lists it: its spec, file and component."""

    spec: TensorSpec
    file: str  # relative to the inspected root (``unet/diffusion_pytorch_model.safetensors``)
    component: str | None = None  # the component of a multi-component root

    @property
    def parameters(self) -> int:
        return self.spec.numel


@dataclass
class ComponentRow:
    """One component of a multi-component root as inspect lists it."""

    name: str
    path: str
    cls: str | None
    format: str  # the component's weights format, or "none" (a scheduler, a tokenizer, pooling)
    tensors: int = 0
    parameters: int = 0
    total_bytes: int = 0


class TensorRows(Sequence[TensorRow]):
    """The tensors of an inspection, stored by column (each name once, a code per row into the
    distinct (dtype, shape) pairs and another into the (file, component) pairs) and selected
    and ordered by an array of rows: a :class:`TensorRow` is built when one is asked for, and
    the totals are counted per kind, so a header of a million tensors is never a million
    records."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._kind: array[int] = array("I")
        self._where: array[int] = array("I")
        self._kinds: list[tuple[str | None, tuple[int, ...]]] = []
        self._kind_codes: dict[tuple[str | None, tuple[int, ...]], int] = {}
        self._places: list[tuple[str, str | None]] = []  # (file, component)
        self._order: array[int] | None = None  # the rows shown, in order (None: every row as added)

    def _code(self, kind: tuple[str | None, tuple[int, ...]]) -> int:
        c = self._kind_codes.get(kind)
        if c is None:
            c = self._kind_codes[kind] = len(self._kinds)
            self._kinds.append(kind)
        return c

    def _place(self, file: str, component: str | None) -> int:
        self._places.append((file, component))
        return len(self._places) - 1

    def add_table(self, table: TensorTable, file: str, component: str | None) -> None:
        """Every tensor of a header, by column (no per-tensor Python work)."""
        codes = [self._code(k) for k in table.kinds]
        self._names.extend(table)
        self._kind.extend(map(codes.__getitem__, table.kind_codes))
        self._where.extend(repeat(self._place(file, component), len(table)))

    def add(self, spec: TensorSpec, file: str, component: str | None) -> None:
        self._names.append(spec.name)
        self._kind.append(self._code((spec.dtype, spec.shape)))
        place = (file, component)
        self._where.append(self._place(*place) if not self._places or self._places[-1] != place
                           else len(self._places) - 1)

    def arrange(self, *, by_component: bool, name_filter: str | None) -> None:
        """Order the rows by (component, name), a stable sort, and keep those whose name matches
        ``name_filter`` (a glob, as :func:`fnmatch.fnmatchcase`)."""
        names = self._names
        if by_component:
            comps, where = [c or "" for _, c in self._places], self._where
            order: list[int] = sorted(range(len(names)), key=lambda i: (comps[where[i]], names[i]))
        else:  # names are unique per family: the same order by name alone
            order = sorted(range(len(names)), key=names.__getitem__)
        if name_filter:
            match = re.compile(fnmatch.translate(name_filter)).match  # = fnmatchcase
            order = [i for i in order if match(names[i])]
        self._order = array("I", order)

    def _rows(self) -> Iterable[int]:
        return range(len(self._names)) if self._order is None else self._order

    def __len__(self) -> int:
        return len(self._names) if self._order is None else len(self._order)

    @overload
    def __getitem__(self, i: int) -> TensorRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[TensorRow]: ...

    def __getitem__(self, i: int | slice) -> TensorRow | list[TensorRow]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._row(self._rows()[i])  # type: ignore[index]

    def _row(self, r: int) -> TensorRow:
        dtype, shape = self._kinds[self._kind[r]]
        file, component = self._places[self._where[r]]
        return TensorRow(TensorSpec(self._names[r], dtype, shape), file, component)

    def __iter__(self) -> Iterator[TensorRow]:
        return map(self._row, self._rows())

    def sizes(self) -> list[tuple[int, int]]:
        """(elements, bytes) of each kind."""
        out = []
        for dtype, shape in self._kinds:
            n = prod(shape)
            d = dt.BY_NAME.get(dtype)  # type: ignore[arg-type]
            out.append((n, n * d.bits // 8 if d else None))  # = TensorSpec.nbytes; None: a dtype no format names
        return out  # type: ignore[return-value]

    def named_rows(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each row shown as its tensor's name and the rest of its JSON object: ``{"name": name,
        **fields}`` is the row. ``fields`` is one dict per (kind, file) shared by the rows that
        have them (do not change it): an encoder can encode it once. The rows are produced by C
        loops (``map``/``zip``), with Python work only per distinct ``fields``."""
        rows, places = self._rows(), len(self._places)
        combos = map(operator.add, map(operator.mul, map(self._kind.__getitem__, rows), repeat(places)),
                     map(self._where.__getitem__, rows))
        return zip(map(self._names.__getitem__, rows), map(_Fields(self).__getitem__, combos))

    def columns(self) -> tuple[list[str], list[int], Mapping[int, dict[str, Any]]]:
        """The rows shown as columns: the names, a code per row, and the JSON fields but the name
        of each code (the ``fields`` of :meth:`named_rows`, made on first use)."""
        rows, places = self._rows(), len(self._places)
        if len(rows) == len(self._names):  # every row: each one's code made in storage order, then looked up
            stored = [kind * places + where for kind, where in zip(self._kind, self._where)]
            codes = list(map(stored.__getitem__, rows))
        else:
            codes = list(map(operator.add, map(operator.mul, map(self._kind.__getitem__, rows), repeat(places)),
                             map(self._where.__getitem__, rows)))
        return list(map(self._names.__getitem__, rows)), codes, _Fields(self)

    def json_rows(self) -> Iterator[dict[str, Any]]:
        """Each row shown as its JSON object."""
        return ({"name": name, **fields} for name, fields in self.named_rows())

    def counts(self, rows: Sequence[int] | None = None) -> Counter[tuple[int, int]]:
        """How many of the rows shown (or of ``rows``) have each (place, kind). A count does not
        depend on the order: when every row is counted (all of them shown, in name order, or
        ``rows`` the whole range), the columns are counted as they are stored."""
        rows = self._rows() if rows is None else rows
        every = len(rows) == len(self._names) and (rows is self._order or rows == range(len(self._names)))
        where = self._where if every else map(self._where.__getitem__, rows)
        kinds = self._kind if every else map(self._kind.__getitem__, rows)
        if len(self._places) == 1:  # one file: count the kinds alone (one C pass)
            return Counter({(0, k): n for k, n in Counter(kinds).items()})
        if every:  # the places in storage order never go down: each one's rows are one slice
            out: Counter[tuple[int, int]] = Counter()
            start = 0
            for place in range(len(self._places)):
                end = bisect_right(self._where, place, start)
                out.update({(place, k): n for k, n in Counter(self._kind[start:end]).items()})
                start = end
            return out
        return Counter(zip(where, kinds))


class _Fields(dict):  # type: ignore[type-arg]
    """A row's JSON fields but its name, per kind * places + place (made on first use)."""

    def __init__(self, rows: TensorRows) -> None:
        super().__init__()
        self._rows, self._sizes = rows, rows.sizes()

    def __missing__(self, combo: int) -> dict[str, Any]:
        kind, place = divmod(combo, len(self._rows._places))
        (dtype, shape), (n, b), (file, component) = self._rows._kinds[kind], self._sizes[kind], self._rows._places[place]
        fields = self[combo] = {"dtype": dtype, "shape": list(shape), "parameters": n, "bytes": b, "file": file}
        if component is not None:
            fields["component"] = component
        return fields


@dataclass
class Inspection:
    """What inspect found in a checkpoint: its format, files, tensors, config and findings."""

    path: str
    format: str
    kind: str | None = None  # the source kind (sources/kinds.py) export reads here; None: a multi-component root
    files: list[dict[str, Any]] = field(default_factory=list)
    tensors: TensorRows = field(default_factory=TensorRows)
    config: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    components: list[ComponentRow] = field(default_factory=list)
    zero: dict[str, Any] = field(default_factory=dict)  # a DeepSpeed ZeRO checkpoint: stage, world_size, tag
    megatron: dict[str, Any] = field(default_factory=dict)  # a Megatron checkpoint: iteration, args, mapping
    state_keys: list[dict[str, Any]] = field(default_factory=list)  # a DCP training state's top-level keys

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
        """Parameters, bytes and the per-dtype totals (sorted by dtype), counted per kind."""
        return _tally(self.tensors, self.tensors.counts())

    def shards(self) -> list[dict[str, Any]]:
        by: dict[str, dict[str, Any]] = {}
        for f in self.files:
            if f["role"] == "weights":
                by[f["name"]] = {"name": f["name"], "size": f["size"], "tensors": 0, "parameters": 0}
        sizes, places = self.tensors.sizes(), self.tensors._places
        for (place, kind), count in self.tensors.counts().items():
            shard = by.get(places[place][0])
            if shard is not None:
                shard["tensors"] += count
                shard["parameters"] += count * sizes[kind][0]
        return list(by.values())

    def to_dict(self, *, with_tensors: bool = True) -> dict[str, Any]:
        """The JSON document (``inspect --json``); ``with_tensors=False`` leaves out the tensor
        rows, which :meth:`TensorRows.json_rows` gives one at a time."""
        parameters, total_bytes, dtypes = self._totals()
        doc: dict[str, Any] = {
            "path": self.path,
            "format": self.format,
            "kind": self.kind,
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
        for name in ("zero", "megatron", "state_keys"):
            if getattr(self, name):
                doc[name] = getattr(self, name)
        if with_tensors:
            doc["tensors"] = list(self.tensors.json_rows())
        return doc


def _tally(rows: TensorRows, counts: Counter[tuple[int, int]]) -> tuple[int, int, dict[str, dict[str, int]]]:
    """Total parameters, total bytes and per-dtype totals (sorted by dtype) of ``counts`` (rows
    per (place, kind)): each kind's size computed once."""
    parameters = total = 0
    by_dtype: dict[str, dict[str, int]] = {}
    sizes, kinds = rows.sizes(), rows._kinds
    for (_, kind), count in counts.items():
        n, nbytes = sizes[kind]
        dtype = kinds[kind][0]
        parameters += n * count
        total += nbytes * count
        d = by_dtype.get(dtype)  # type: ignore[arg-type]
        if d is None:
            d = by_dtype[dtype] = {"tensors": 0, "parameters": 0, "bytes": 0}  # type: ignore[index]
        d["tensors"] += count
        d["parameters"] += n * count
        d["bytes"] += nbytes * count
    return parameters, total, dict(sorted(by_dtype.items()))


def config_summary(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config fields that matter, under their Llama-style names (``config_fields`` knows the
    other names and the nested ``text_config``)."""
    return ConfigFields(cfg).summary(CONFIG_FIELDS)


def inspect_path(path: str | os.PathLike[str], *, only: str | None = None,
                 name_filter: str | None = None, key: str | None = None) -> Inspection:
    """Describe the checkpoint at ``path``; a multi-component root (diffusers pipeline,
    sentence-transformers model) is described component by component. ``key`` selects the
    state dict of a pickle or DCP source that holds several (a training state is refused
    without it, with the keys to choose from)."""
    # the index and every header: acyclic objects, freed by reference counting
    # one version of a directory a publish replaces (layout.version): read again if it was replaced
    with paused():
        return one_version(path, lambda _: _inspect(Path(path), only=only, name_filter=name_filter, key=key))


def _inspect(p: Path, *, only: str | None, name_filter: str | None, key: str | None) -> Inspection:
    """:func:`inspect_path`'s steps: the located kind at ``p`` (``sources/kinds.locate``: its own
    inspect hook), else the layout's families."""
    from ckptctl.layout.reading import MetadataReading
    from ckptctl.sources import kinds

    reading = MetadataReading(agreement=False)
    found = kinds.locate(p, only=only)
    if found is not None:
        res = found.kind.hook("inspect")(found.location, p, only=only, name_filter=name_filter, key=key,
                                         reading=reading)
        if res is not None:  # None: DCP-HF beside the same consolidated files, which the layout reads
            return res
    lay = L.scan(p, reading=reading)
    if not lay.components:
        fam = L.choose(lay, prefer=only) if lay.families else None
        if fam is None:
            raise InputError(f"{p} holds no checkpoint weights", "pass a checkpoint directory or a weights file")
        res = Inspection(path=str(p), format=_format(fam), kind=fam.kind, findings=list(lay.findings))
        add_family(res, p, lay, fam, only=only, key=key)
    else:
        res = Inspection(path=str(p), format=lay.kind, findings=list(lay.findings))
        for comp in lay.components:
            sub = lay if comp.path == "" else comp.layout
            fam = L.choose(sub, prefer=only) if sub is not None and sub.families else None
            row = ComponentRow(comp.name, comp.path, comp.cls, _format(fam) if fam else "none")
            res.components.append(row)
            if fam is None:
                continue
            if sub is not lay:
                res.findings.extend(sub.findings)
            before = len(res.tensors)
            add_family(res, sub.root, sub, fam, only=only, component=comp.name, prefix=comp.path)
            added = range(before, len(res.tensors))
            row.tensors = len(added)
            row.parameters, row.total_bytes, _ = _tally(res.tensors, res.tensors.counts(added))
    res.tensors.arrange(by_component=bool(res.components), name_filter=name_filter)
    cfg = read_config(lay.root) if lay.single_file is None else None
    if cfg is not None and isinstance(cfg, dict):
        res.config = config_summary(cfg)
    return res


def _format(fam: L.Family) -> str:
    if fam.kind == L.SAFETENSORS:
        return "safetensors-sharded" if fam.index else "safetensors"
    return fam.kind


def add_family(res: Inspection, p: Path, lay: L.Layout, fam: L.Family, *, only: str | None,
                component: str | None = None, prefix: str = "", key: str | None = None) -> None:
    """Add a family's files and tensors to ``res``; names are relative to the inspected root."""
    def rel(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    root = str(lay.root)  # (joined as text: 163 shards' paths are not worth a Path each)

    def file_row(name: str, role: str) -> dict[str, Any]:
        try:
            size = os.stat(os.path.join(root, name)).st_size
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

    if fam.container == L.DCP and not key:
        from ckptctl.format.dcp_metadata import is_training_state, state_summary
        from ckptctl.sources.dcp.source import read_dcp_metadata

        meta = read_dcp_metadata(lay.root)
        if is_training_state(meta):  # {"model": ..., "optimizer": ..., "step": n}: its keys, --key picks one
            res.state_keys = state_summary(meta)
            return
    if fam.container == L.SAFETENSORS:
        for n in fam.files:
            path = str(lay.root / n)  # (as a Path shows it: the path findings name)
            hdr = lay.reading.load_header(path, display=path, keep=False)
            res.tensors.add_table(hdr.tensors, rel(n), component)
    else:
        from ckptctl.sources import open_source

        with open_source(p, only=only, key=key, reading=lay.reading) as src:
            res.aliases.update(src.aliases)
            for t in src.tensors:
                where = Path(t.file).name if t.file else _pickle_file(fam)
                res.tensors.add(t.spec, rel(where), component)


def _pickle_file(fam: L.Family) -> str:
    """Which pickle a tensor came from (sharded pickles are not told apart: "*")."""
    return fam.files[0] if len(fam.files) == 1 else "*"
