"""The saves a repair chooses between: one layout family of the model's slot split into the
families that separate writes left behind.

``layout.scan`` groups every ``model*.safetensors`` of a slot into one sharded family (the index
and the shards it names) and one single file. A re-save that did not clean up leaves more than
one save in that group: a stale index beside a newer single file, the shards of an earlier
``-of-00003`` save beside a newer complete ``-of-00002`` save whose writer died before its index,
the surplus shards of a larger earlier save. Each of those is a :class:`~ckptctl.layout.Family`
here, labelled so that ``--prefer`` can name it, and assessed from the headers alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptctl import layout as L
from ckptctl.config_fields import ConfigFields, as_int
from ckptctl.findings import ERROR, Finding
from ckptctl.format import names as N
from ckptctl.format.header import Header, MergedSpecs
from ckptctl.layout.reading import MetadataReading
from ckptctl.tensor_names import TensorNames


def read_all(root: Path, names: list[str], reading: MetadataReading) -> tuple[dict[str, Header], list[Finding]]:
    """The headers of ``names`` (read by ``reading``) and every problem that makes a file unusable
    (missing, corrupt header, truncated data; trailing bytes are repairable, not a problem)."""
    headers, problems = {}, []
    for n in names:
        p = str(root / n)  # (one path made per file: the path its findings name)
        if not os.path.isfile(p):
            problems.append(Finding("index.shard_missing", ERROR, p, f"{n} is missing"))
            continue
        h = reading.header(p, display=p)
        fatal = [f for f in h.findings if f.severity == ERROR and f.code != "header.trailing_bytes"]
        if fatal:
            problems.extend(fatal)
        headers[n] = h
    return headers, problems


_LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")
# _LAYER's first match in a line (the lazy prefix: its leftmost), with every following line that
# starts with the same text up to the end of that match: such a line's first match is the same one
# (a match that starts earlier would lie inside the shared text, and match the first line too).
# A layer's names sit side by side: one match per run of them, not per name.
_LAYER_RUNS = re.compile(r"\n(?P<pre>[^\n]*?\.(?:layers|h|blocks)\.(?P<n>\d+)\.)[^\n]*(?:\n(?P=pre)[^\n]*)*")


def _layer_numbers(names: "list[str] | TensorNames") -> set[int]:
    """The layer number each name carries (its first ``.layers.N.``, ``.h.N.`` or ``.blocks.N.``):
    one regex pass over the names joined by lines (90k names in one call, a match per run of
    names in one layer), or name by name when a name holds a line break itself."""
    joined = names if isinstance(names, TensorNames) else TensorNames(dict.fromkeys(names))
    if joined.text is not None:
        return set(map(int, {m.group("n") for m in _LAYER_RUNS.finditer(joined.text)}))  # each distinct text once
    return {int(m.group(1)) for m in map(_LAYER.search, joined.names) if m}


_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "lm_head.weight")


def config_mismatches(tensors: Mapping[str, Any], cfg: dict[str, Any] | None) -> int:
    """How many of config.json's basic facts a tensor set (records with a ``shape``, by name)
    contradicts (0 = consistent). Only the embeddings' records are looked up; the names are read
    as one text (:class:`TensorNames`), not one by one."""
    if not cfg:
        return 0
    bad = 0
    fields = ConfigFields(cfg)
    vocab = as_int(fields.get("vocab_size"))
    layers = as_int(fields.get("num_hidden_layers"))
    if not vocab and not isinstance(layers, int):
        return 0
    names = TensorNames(tensors)
    for name in names.ending_any(_EMBEDDINGS) if vocab else ():
        t = tensors[name]
        if t.shape:
            bad += t.shape[0] != vocab
    if isinstance(layers, int):
        idx = _layer_numbers(names)
        if idx and (len(idx) != layers or min(idx) != 0 or max(idx) != layers - 1):  # never range(layers)
            bad += 1
    return bad


@dataclass
class Save:
    """One candidate family and what its files say about it."""

    family: L.Family
    missing: list[str]  # files the family names (its index, or its -of-N count) that are not there
    gaps_only: bool = False  # nothing names the missing files but their -of-N count (no index)


def split(root: Path, fam: L.Family, names: list[str]) -> list[Save]:
    """The saves one layout family holds. ``names`` is the directory listing. A single file is
    one save. A sharded family is: the index with the shards it names and the other shards of the
    same ``-of-N`` counts (one save wrote them), plus one save per other ``-of-N`` count of the
    slot's shards that the index does not name (or per count, when there is no usable index)."""
    if not fam.sharded:
        return [Save(fam, [])]
    key = _shard_key(fam)
    shards = sorted(n for n in names if (w := N.parse_weights_name(n)) is not None and w.shard
                    and (w.stem, w.ext, w.variant) == key)
    doc = fam.index_doc if usable_index(fam) else None
    saves: list[Save] = []
    claimed: set[str] = set()
    if doc is not None:
        named = list(doc.shards)
        counts = {w.shard[1] for n in named if (w := N.parse_weights_name(n)) is not None and w.shard}
        same = [n for n in shards if n not in named and _count(n) in counts]
        files = [n for n in named if n in fam.files] + same
        missing = [n for n in named if n not in fam.files] + _gaps(key, files, counts)
        saves.append(Save(L.Family(fam.kind, sorted(files), index=fam.index, container=fam.container,
                                   stem=fam.stem, variant=fam.variant, index_doc=fam.index_doc), sorted(set(missing))))
        claimed.update(named)
        claimed.update(same)
    by_count: dict[int, list[str]] = {}
    for n in shards:
        if n not in claimed:
            by_count.setdefault(_count(n), []).append(n)
    for count, files in sorted(by_count.items()):
        gaps = _gaps(key, files, {count})
        saves.append(Save(L.Family(fam.kind, sorted(files), index=None, container=fam.container, stem=fam.stem,
                                   variant=fam.variant), gaps, gaps_only=bool(gaps)))
    if not saves and fam.index is not None:  # an index and none of its shards
        saves.append(Save(L.Family(fam.kind, [], index=fam.index, container=fam.container, stem=fam.stem,
                                   variant=fam.variant, index_doc=fam.index_doc), []))
    return saves


def usable_index(fam: L.Family) -> bool:
    """The family's index was read and maps tensors to files."""
    return fam.index_doc is not None and fam.index_doc.ok and bool(fam.index_doc.shards)


def _shard_key(fam: L.Family) -> tuple[str | None, str, str | None]:
    ext = N.SAFETENSORS_EXT if fam.container == L.SAFETENSORS else N.BIN_EXT
    return fam.stem, ext, fam.variant


def _count(name: str) -> int:
    w = N.parse_weights_name(name)
    assert w is not None and w.shard is not None
    return w.shard[1]


def _gaps(key: tuple[str | None, str, str | None], files: list[str], counts: set[int]) -> list[str]:
    """The shard names of each ``-of-N`` count that no file in ``files`` has."""
    have = {w.shard for n in files if (w := N.parse_weights_name(n)) is not None and w.shard}
    stem, ext, variant = key
    return [N.weights_file_name(stem or "model", ext, variant=variant, shard=(k, c))
            for c in sorted(counts) for k in range(1, c + 1) if (k, c) not in have]


def is_complete(save: Save, problems: list[Finding]) -> bool:
    """Every file of the save there with a sound header (``problems``: ``read_all``'s)."""
    return not problems and not save.missing and bool(save.family.files)


def assess(root: Path, save: Save, cfg: dict[str, Any] | None,
           read: tuple[dict[str, Header], list[Finding]]) -> L.Assessment:
    """Complete (every file there with a sound header), consistent with config.json, how many
    tensors, and when it was last written. ``read``: ``read_all`` of the save's files."""
    headers, problems = read
    tensors = MergedSpecs([h.tensors for h in headers.values()])
    mtime = max((_mtime(root / n) for n in save.family.all_files), default=0.0)
    return L.Assessment(complete=is_complete(save, problems),
                        agrees=config_mismatches(tensors, cfg) == 0, tensors=len(tensors), mtime=mtime,
                        missing=tuple(save.missing))


def _mtime(p: Path) -> float:
    return mtime_ns(p) / 1e9


def mtime_ns(p: Path) -> int:
    """When ``p`` was last written (0 when it cannot be read)."""
    try:
        return os.stat(p).st_mtime_ns
    except OSError:
        return 0
