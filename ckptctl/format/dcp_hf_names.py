"""The names of torch's DCP-HF shards (``torch.distributed.checkpoint``'s ``_gen_file_name`` with a
shard index: ``shard-RRRRR-model-IIIII-of-NNNNN.safetensors``, rank ``R``'s part of model file
``I`` of ``N``) and what they say is missing. Shared by layout (which family a directory holds),
the export source and verify."""

from __future__ import annotations

import itertools
import re

SHARD_NAME = re.compile(r"shard-(\d{5,})-model-(\d{5,})-of-(\d{5,})\.safetensors")
SHARDED_DIR = "sharded"  # where HuggingFaceStorageWriter(enable_consolidation=True) puts them


def missing_models(names: list[str]) -> str | None:
    """What torch's ``shard-RRRRR-model-IIIII-of-NNNNN`` names say is missing: a model file
    ``I`` of ``N`` that no rank wrote (each model file is written by at least one rank, so its
    tensors are gone), or saves with different ``N``; None when nothing is."""
    numbers = [m.groups() for m in map(SHARD_NAME.fullmatch, names) if m]
    totals = {int(of) for _, _, of in numbers}
    if len(totals) > 1:
        return f"the shard names say the save has {' and '.join(map(str, sorted(totals)))} model files"
    missing = sorted(set(range(1, max(totals) + 1)) - {int(i) for _, i, _ in numbers}) if totals else []
    if missing:
        return f"the shard names say model files {', '.join(map(str, missing[:5]))} of {max(totals)} are missing"
    return None


def absent_shard(names: list[str]) -> str:
    """The first of torch's ``shard-RRRRR-model-IIIII-of-NNNNN`` names missing from ``names``
    (shards 1 up to the largest, models 1 to N), for a message: a rank may legitimately write no
    file of a model index, so this only names a suspect once a tensor has a hole."""
    seen = [m for m in map(SHARD_NAME.fullmatch, names) if m]
    if not seen:
        return ""
    ranks, total = max(int(m.group(1)) for m in seen), max(int(m.group(3)) for m in seen)
    if ranks * total > 4 * len(names) + 64:  # not a grid torch wrote: no suspect to name
        return ""
    have = set(names)
    for r, c in itertools.product(range(1, ranks + 1), range(1, total + 1)):
        name = f"shard-{r:05d}-model-{c:05d}-of-{total:05d}.safetensors"
        if name not in have:
            return f" (no {name})"
    return ""
