"""Shard planning from tensor metadata alone (pure: no I/O, no torch).

Grouping is huggingface_hub's own ``split_state_dict_into_shards_factory``, fed each tensor's
stored size: greedy in input order, limits inclusive, a tensor that alone exceeds the limit goes
into a shard of its own (appended at once, before the shard being filled). Tied tensors never
reach the plan: sources list them once and record the alias. File names come from
``ckptctl.format.names``: ``{prefix}-00001-of-0000N.safetensors``, or ``{prefix}.safetensors``
for a single shard, and ``{prefix}.safetensors.index.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Callable, Iterable, Sequence

from ckptctl.format import names as N
from ckptctl.format.header import TensorInfo, encode_header
from ckptctl.format.tensor import TensorSpec

MAX_SHARDS = 99_999


@dataclass
class ShardPlan:
    """One output shard: its tensors, header and layout, or the existing file it is linked from."""

    name: str
    specs: list[TensorSpec]  # in input order
    metadata: dict[str, str] | None
    header: bytes = b""
    layout: list[TensorInfo] = field(default_factory=list)  # file order, offsets in the data section
    # An existing file with exactly these bytes: hard-linked instead of written (resave).
    link_from: str | None = None

    @property
    def data_start(self) -> int:
        """File offset of the data section (a tensor sits at ``data_start + info.begin``)."""
        return len(self.header)

    @property
    def data_bytes(self) -> int:
        # the layout (once the header is encoded) is contiguous from 0: its last end is the sum
        return self.layout[-1].end if self.layout else sum(s.nbytes for s in self.specs)

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass
class Plan:
    """An export's shards, index name and totals."""

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
    """Group names (with their stored sizes) into shards: huggingface_hub's grouping itself."""
    by_name = dict(sizes)
    if by_name and sum(by_name.values()) <= max_shard_size:
        return [list(by_name)]  # all in one shard, as the hub groups them, without importing it (40 ms)
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(by_name, get_storage_size=lambda size: size,
                                                 filename_pattern="{suffix}", max_shard_size=max_shard_size)
    return list(split.filename_to_tensors.values())


def with_alias_records(metadata: dict[str, str] | None, aliases: dict[str, str]) -> dict[str, str]:
    """The metadata a checkpoint records: the user's, plus ``{alias: kept name}`` for each tied
    tensor stored once (as transformers records them), the user's keys winning."""
    out = dict(metadata or {})
    out.update({k: v for k, v in aliases.items() if k not in out})
    return out


def make_plan(specs: list[TensorSpec], *, max_shard_size: int, prefix: str = "model",
              metadata: dict[str, str] | None = None, aliases: dict[str, str] | None = None,
              single_file: bool = False, groups: list[list[str]] | None = None,
              variant: str | None = None) -> Plan:
    """Plan the shards, their names and header bytes. ``specs`` have unique names (the export
    job checks that once, before planning).

    ``metadata`` is the user's metadata: in a single file it goes into the header next to
    ``format: pt`` (with the alias records), in a sharded checkpoint into the index, while each
    shard's header carries ``format: pt`` only (huggingface_hub's convention). Raises
    ``ValueError`` when the shards would be too many to name. ``groups`` replaces the grouping
    (``--max-shard-size keep``: the source's own shards).
    """
    sizes = [s.nbytes for s in specs]
    total = sum(sizes)
    aliases = dict(aliases or {})
    if groups is None and (single_file or total <= max_shard_size):
        groups = [[s.name for s in specs]]  # one shard, as the hub groups them (without importing it)
    elif groups is None:
        groups = group(zip((s.name for s in specs), sizes), max_shard_size)
    whole = len(groups) == 1 and groups[0] == [s.name for s in specs]
    by_name = {} if whole else {s.name: s for s in specs}
    if len(groups) > MAX_SHARDS:
        raise ValueError(f"{len(groups)} shards exceed the {MAX_SHARDS}-shard naming limit; raise --max-shard-size")
    n = len(groups)
    extra = with_alias_records(metadata, aliases)
    shards: list[ShardPlan] = []
    for i, names in enumerate(groups, start=1):
        name = N.weights_file_name(prefix, N.SAFETENSORS_EXT, variant=variant, shard=(i, n) if n > 1 else None)
        md = {"format": "pt", **extra} if n == 1 else {"format": "pt"}
        sp = ShardPlan(name, list(specs) if whole else [by_name[x] for x in names], md)
        sp.header, sp.layout = encode_header(sp.specs, md)
        shards.append(sp)
    params = sum(map(prod, [s.shape for s in specs]))
    index = N.index_name(prefix, N.SAFETENSORS_EXT, variant=variant) if n > 1 else None
    return Plan(shards, index, total, params, aliases)


# Where a tensor's stored bytes already sit, when they can be copied as they are: (file, offset).
Locate = Callable[[str], "tuple[str, int] | None"]


@dataclass(frozen=True)
class Run:
    """Consecutive tensors of a shard (``infos``, file order) whose bytes sit back to back in one
    source ``file`` from ``src_offset``: one range to copy (or clone)."""

    infos: tuple[TensorInfo, ...]
    file: str
    src_offset: int

    @property
    def begin(self) -> int:
        return self.infos[0].begin

    @property
    def nbytes(self) -> int:
        return self.infos[-1].end - self.infos[0].begin


def runs(layout: Sequence[TensorInfo], locate: Locate) -> list[Run | TensorInfo]:
    """``layout`` (file order) cut into :class:`Run` s of tensors contiguous both here and in one
    source file, and the tensors that have no source range (as themselves)."""
    out: list[Run | TensorInfo] = []
    cur: list[TensorInfo] = []
    file, start, end = "", 0, 0
    last_end = 0  # where the last tensor of ``cur`` ends in this shard
    for info in layout:  # attributes read once each: this loop runs per tensor of every shard
        begin, stop = info.begin, info.end
        where = locate(info.spec.name) if stop != begin else None
        if where is not None and cur and where[0] == file and where[1] == end and begin == last_end:
            cur.append(info)
            end += stop - begin
            last_end = stop
            continue
        if cur:
            out.append(Run(tuple(cur), file, start))
            cur = []
        if where is None:
            out.append(info)
        else:
            cur = [info]
            file, start, end = where[0], where[1], where[1] + stop - begin
            last_end = stop
    if cur:
        out.append(Run(tuple(cur), file, start))
    return out


def place_for_clone(shard: ShardPlan, locate: Locate, block: int) -> int:
    """Pad ``shard``'s header with spaces (beyond the 8-byte alignment safetensors writes) so
    that its largest run sits at the same offset modulo ``block`` as in its source file, where
    the kernel can then clone it. Only a multiple of 8 is added (every tensor keeps its 8-byte
    alignment); nothing when the run is shorter than a block or already congruent. Returns the
    spaces added."""
    candidates = [r for r in runs(shard.layout, locate) if isinstance(r, Run)]
    if not candidates or block <= 8:
        return 0
    best = max(candidates, key=lambda r: (r.nbytes, -r.begin))
    if best.nbytes < block:
        return 0
    pad = (best.src_offset - best.begin - shard.data_start) % block
    if pad == 0 or pad % 8:
        return 0
    shard.header, shard.layout = encode_header(shard.specs, shard.metadata, extra_pad=pad)
    return pad
