"""Shard planning from tensor metadata alone (pure: no I/O, no torch).

Grouping is huggingface_hub's ``split_state_dict_into_shards_factory``: greedy in input order, a
tensor that alone exceeds the limit goes into a shard of its own (appended at once, before the
shard being filled), limits are inclusive. Names are ``{prefix}-00001-of-0000N.safetensors`` or
``{prefix}.safetensors`` for a single shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ckptctl.format import dtypes as dt
from ckptctl.format.header import TensorInfo, encode_header
from ckptctl.format.tensor import TensorSpec

MAX_SHARDS = 99_999


@dataclass
class ShardPlan:
    name: str
    specs: list[TensorSpec]  # in input order
    metadata: dict[str, str] | None
    header: bytes = b""
    layout: list[TensorInfo] = field(default_factory=list)  # file order, offsets in the data section
    # An existing file with exactly these bytes: hard-linked instead of written (resave).
    link_from: str | None = None

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass
class Plan:
    shards: list[ShardPlan]
    index_name: str | None
    total_size: int
    total_parameters: int
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def weight_map(self) -> dict[str, str]:
        return {s.name: sh.name for sh in self.shards for s in sh.specs}

    @property
    def bytes_to_write(self) -> int:
        return sum(s.file_size for s in self.shards if s.link_from is None)

    @property
    def files(self) -> list[str]:
        return [s.name for s in self.shards] + ([self.index_name] if self.index_name else [])


def group(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Group names into shards exactly as huggingface_hub does for the same sizes."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard_size:
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def make_plan(specs: list[TensorSpec], *, max_shard_size: int, prefix: str = "model",
              metadata: dict[str, str] | None = None, aliases: dict[str, str] | None = None,
              single_file: bool = False) -> Plan:
    """Plan the shards, their names and header bytes.

    ``metadata`` is the user's metadata: in a single file it goes into the header next to
    ``format: pt`` (with the alias records), in a sharded checkpoint into the index, while each
    shard's header carries ``format: pt`` only (huggingface_hub's convention).
    """
    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs):
        seen: set[str] = set()
        dup = next(s.name for s in specs if s.name in seen or seen.add(s.name))  # type: ignore[func-returns-value]
        raise ValueError(f"tensor {dup!r} is given twice")
    aliases = dict(aliases or {})
    groups = [list(by_name)] if single_file else group(((s.name, s.nbytes) for s in specs), max_shard_size)
    if len(groups) > MAX_SHARDS:
        raise ValueError(f"{len(groups)} shards exceed the {MAX_SHARDS}-shard naming limit; raise --max-shard-size")
    n = len(groups)
    extra = dict(metadata or {})
    extra.update({k: v for k, v in aliases.items() if k not in extra})
    shards: list[ShardPlan] = []
    for i, names in enumerate(groups, start=1):
        name = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i:05d}-of-{n:05d}.safetensors"
        md = {"format": "pt", **extra} if n == 1 else {"format": "pt"}
        sp = ShardPlan(name, [by_name[x] for x in names], md)
        sp.header, sp.layout = encode_header(sp.specs, md)
        shards.append(sp)
    total = sum(s.nbytes for s in specs)
    params = sum(dt.numel(s.shape) for s in specs)
    index = f"{prefix}.safetensors.index.json" if n > 1 else None
    return Plan(shards, index, total, params, aliases)
