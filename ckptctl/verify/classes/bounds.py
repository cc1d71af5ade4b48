"""Cheap bounds on config.json before the box (:mod:`.box`) is asked to build anything: what the
JSON alone shows would make a class of absurd size is a note at once, so the common hostile cases
never start a build (issue 44). The box's time and memory bounds stay the guard for the rest.

* counts of repeated modules: a count-like integer (``num_hidden_layers``, ``n_layer``,
  ``num_local_experts``, ``layers_per_block``, and any other ``num_*``/``n_*``/``*_layers``/
  ``*groups``/``*depths`` field: ALBERT's ``num_hidden_groups``) past :data:`MAX_COUNT`, or a
  list of counts (Swin's ``depths``) whose sum is; fields that measure a size rather than count
  modules (vocabularies, positions, codebooks, buckets) are left to the box;
* label maps: ``num_labels`` (or any ``num_*labels``) or an ``id2label``/``label2id`` past
  :data:`MAX_LABELS` (the config class builds the map in Python);
* LoRA ranks: an adapter's ``r`` or a ``rank_pattern`` value larger than every dimension of its
  stored tensors (no stored tensor can be of that rank; the adapter rules report the rank).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.classes.outcome import NotChecked

MAX_COUNT = 1 << 16  # the largest count of repeated modules a class is built with
MAX_LABELS = 1 << 18  # the largest label map (ImageNet-22k has 21,843 labels)
MAX_DEPTH = 8  # sub-configs looked into
COUNT_KEY = re.compile(r"^(num|n)_|(layers?|experts|blocks?|groups|depths?|stages|repeats?|_count)$")
# count-like names that measure a size, not a number of modules
SIZE_WORDS = ("vocab", "embed", "position", "token", "bucket", "code", "bin", "mel", "frame", "sample", "freq",
              "seq", "ctx", "size", "dim", "len", "max", "channel", "feature", "step", "patch", "pixel", "class",
              "label", "word", "char", "time", "hash", "embd", "inner", "intermediate")  # word beginnings
LABEL_KEY = re.compile(r"^num_(\w*_)?labels$")
LABEL_MAPS = ("id2label", "label2id")


def _fields(doc: Any, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every (key, value) of config.json and its sub-configs (dicts, to :data:`MAX_DEPTH`)."""
    if depth > MAX_DEPTH or not isinstance(doc, dict):
        return
    for k, v in doc.items():
        if isinstance(k, str):
            yield k, v
        if isinstance(v, dict) and k not in LABEL_MAPS:
            yield from _fields(v, depth + 1)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def count_like(key: str) -> bool:
    """Whether a config field counts repeated modules."""
    low = key.lower()
    return bool(COUNT_KEY.search(low)) and not any(part.startswith(SIZE_WORDS) for part in low.split("_"))


def check_config(cfg: Mapping[str, Any]) -> None:
    """:class:`NotChecked` for a count or label map in config.json past the bounds."""
    for k, v in _fields(cfg):
        if LABEL_KEY.match(k) and _integer(v) and v > MAX_LABELS:
            raise NotChecked(f"config.json's {k} is {v:,}: a label map of more than {MAX_LABELS:,} labels is not "
                             "built")
        if k in LABEL_MAPS and isinstance(v, dict) and len(v) > MAX_LABELS:
            raise NotChecked(f"config.json's {k} holds {len(v):,} labels: a label map of more than {MAX_LABELS:,} "
                             "labels is not built")
        if not count_like(k):
            continue
        if _integer(v) and v > MAX_COUNT:
            raise NotChecked(f"config.json's {k} is {v:,}: a class with that many modules is not built")
        if isinstance(v, list):
            total = sum(x for x in v if _integer(x) and x > 0)
            if total > MAX_COUNT:
                raise NotChecked(f"config.json's {k} sums to {total:,}: a class with that many modules is not built")


def _ranks(acfg: Mapping[str, Any]) -> Iterator[tuple[str, int]]:
    if _integer(acfg.get("r")):
        yield "r", acfg["r"]
    pattern = acfg.get("rank_pattern")
    if isinstance(pattern, dict):
        for k, v in pattern.items():
            if _integer(v):
                yield f"rank_pattern[{k!r}]", v


def check_adapter(acfg: Mapping[str, Any], tensors: Mapping[str, TensorSpec]) -> None:
    """:class:`NotChecked` for a LoRA rank in adapter_config.json larger than every dimension of
    the adapter's stored tensors (peft would build layers of that rank first)."""
    largest = max((d for t in tensors.values() for d in t.shape), default=0)
    if not largest:
        return  # nothing stored to compare with: peft's loading reports it
    for field, rank in _ranks(acfg):
        if rank > largest:
            raise NotChecked(f"adapter_config.json's {field} is {rank:,}, larger than every dimension of the stored "
                             f"adapter tensors (at most {largest:,}): an adapter of that rank is not built")
