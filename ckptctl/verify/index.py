"""A sharded family's index against its shards: what the index maps where, shard numbering,
``total_size``/``total_parameters`` and alias records.

The index was read once by ``layout.scan`` (``Family.index_doc``; its own findings are in the
layout's findings), and layout decided which of the shards it names are files of the checkpoint
(the others are ``layout.shard_missing``). Only an index layout accepted is cross-checked; a broken
one speaks through its own findings and the family is read by its file names.
"""

from __future__ import annotations

import os
from typing import Any

from ckptctl import layout as L
from ckptctl.config_fields import as_int
from ckptctl.findings import ERROR, WARNING
from ckptctl.format import names as N
from ckptctl.format.index import Index
from ckptctl.verify import weights as W
from ckptctl.verify.context import Context, FamilyTensors, WeightsRead

_REPAIR = "run `ckptctl resave --repair DIR` to rebuild the index from the shard headers"


def family_tensors(ctx: Context, fam: L.Family) -> FamilyTensors:
    """The tensors of a safetensors or pickle family, its index checked against its shards (torch's
    DCP-HF shards: assembled by their sharding info)."""
    if fam.container == L.DCP_HF:
        from ckptctl.verify.dcp import check_dcp_hf

        return check_dcp_hf(ctx, fam)
    return read_indexed(ctx, fam) if fam.index_doc is not None else W.read_family(ctx, fam)


def read_indexed(ctx: Context, fam: L.Family) -> FamilyTensors:
    assert fam.index is not None and fam.index_doc is not None
    doc: Index = fam.index_doc
    ctx.record(fam.index, "index")
    shown = ctx.disp(fam.index)
    if not doc.ok or not doc.shards:
        if doc.ok:
            ctx.add("index.empty", ERROR, shown, f"{shown}: weight_map is empty", _REPAIR)
        return W.read_family(ctx, fam, complete=False)
    ext = "." + (N.SAFETENSORS_EXT if fam.container == L.SAFETENSORS else N.BIN_EXT)
    files = set(fam.files)  # layout: the named shards that are safe names and regular files
    reads: dict[str, WeightsRead] = {}
    shards = doc.shards  # sorted once
    for shard in shards:
        if N.member_problem(shard):
            continue  # layout.shard_missing says why
        if not shard.endswith(ext):
            ctx.add("index.shard_extension", ERROR, shown,
                    f"{shown} names shard {shard!r}, which is not a {ext} file; not opened", _REPAIR, name=shard)
            continue
        if shard in files and ctx.inside(shard) is not None:
            reads[shard] = W.read_file(ctx, shard, fam.container)
    readable = {s: r.names for s, r in reads.items() if r.names is not None}
    # every readable shard holds exactly the names the index maps to it (and, when every shard it
    # names is readable, it maps no other name)
    agreed = doc.agrees(readable, whole=readable.keys() >= set(shards))
    complete = set(shards) <= set(reads) and all(r.names is not None for r in reads.values())
    # agreeing with every shard it names, each holding only its tensors' names, the index is the
    # merged view's index of names (no second dict of every tensor); a worker's reading has no map
    # at hand, and the shards are then known to hold no name twice
    exact = agreed and complete and all(len(r.names) == len(r.tensors) for r in reads.values())  # type: ignore[arg-type]
    table = W.merge(ctx, reads, where=doc.parsed_map() if exact else None, disjoint=exact)
    if not agreed:
        _cross_check(ctx, shown, doc.shared_map, reads)
    if not any(N.member_problem(s) for s in shards):
        _numbering(ctx, shown, shards, ext)
    if fam.container == L.SAFETENSORS:
        _totals(ctx, shown, doc.metadata, reads, shards)
    if W.alias_records(doc.metadata):  # the stored names are collected only for alias records to look up
        names = set().union(*(r.names or set() for r in reads.values()))
        ctx.extend(W.alias_findings(doc.metadata, names, shown))
    W.shard_sizes(ctx, reads)
    return FamilyTensors(fam, table, complete, facts=doc.name_facts if exact else None)


def _cross_check(ctx: Context, shown: str, wm: dict[str, str], reads: dict[str, WeightsRead]) -> None:
    """What is wrong between an index that does not agree with its shards (:meth:`Index.agrees`) and them."""
    located: dict[str, list[str]] = {}
    for shard, r in reads.items():
        for t in r.names or ():
            located.setdefault(t, []).append(shard)
    readable = {s for s, r in reads.items() if r.names is not None}
    for t, shard in sorted(wm.items()):
        if shard not in readable:
            continue  # a missing or unreadable shard is reported once, elsewhere
        homes = located.get(t, [])
        if shard in homes:
            continue
        if len(homes) == 1:
            ctx.add("index.wrong_shard", ERROR, shown, f"{shown} maps {t!r} to {shard}, but it is stored in {homes[0]}",
                    _REPAIR, tensor=t, indexed=shard, actual=homes[0])
        elif not homes:
            ctx.add("index.tensor_missing", ERROR, ctx.disp(shard),
                    f"{shown} maps {t!r} to {shard}, which does not hold it",
                    _REPAIR + " (if the tensor is really gone, re-export the checkpoint)", tensor=t, shard=shard)
    for t, homes in sorted(located.items()):
        if t not in wm:
            ctx.add("index.tensor_not_indexed", ERROR, ctx.disp(homes[0]),
                    f"{homes[0]} holds {t!r}, which {os.path.basename(shown)} does not list "
                    "(transformers loads it anyway; huggingface_hub does not)", _REPAIR, tensor=t)


def _numbering(ctx: Context, shown: str, shards: list[str], ext: str) -> None:
    groups: dict[tuple[str, int], set[int]] = {}
    odd: list[str] = []
    for s in shards:
        parsed = N.parse_shard_number(s)
        if parsed and s.endswith(ext):
            prefix, i, n, _ = parsed
            groups.setdefault((prefix, n), set()).add(i)
        else:
            odd.append(s)
    if odd and len(shards) > 1:
        ctx.add("index.nonstandard_name", WARNING, shown,
                f"{shown} names shards outside the PREFIX-00001-of-0000N pattern ({', '.join(odd[:3])})",
                "ckptctl resave renames shards to the standard pattern", names=odd[:20])
    if len(groups) > 1:
        ctx.add("index.shard_numbering", ERROR, shown,
                f"{shown} mixes shard families: {', '.join(f'{p}-*-of-{n:05d}' for p, n in sorted(groups))}",
                _REPAIR, families=[f"{p}-of-{n}" for p, n in sorted(groups)])
        return
    for (prefix, n), got in groups.items():
        missing = sorted(set(range(1, n + 1)) - got)
        beyond = sorted(i for i in got if i < 1 or i > n)
        if missing or beyond or len(got) + len(odd) != n:
            ctx.add("index.shard_numbering", ERROR, shown,
                    f"{shown} names {len(got)} shards of {prefix}-*-of-{n:05d}"
                    + (f"; missing numbers {', '.join(map(str, missing[:10]))}" if missing else "")
                    + (f"; numbers beyond {n}: {', '.join(map(str, beyond[:10]))}" if beyond else ""),
                    "the index and the shard set disagree: restore the missing shards or re-export",
                    missing=missing[:100], count=len(got), expected=n)


# Leaf names of the persistent buffers transformers' models register (``nn.Buffer``): stored in the
# checkpoint, but not parameters. transformers writes ``total_parameters`` as ``num_parameters()``,
# the sum over ``named_parameters()``: each shared (tied) parameter once, and no buffer; so BART's
# ``final_logits_bias`` or DeepSeek-V3's ``e_score_correction_bias`` are stored and not counted.
BUFFER_LEAVES = frozenset({"final_logits_bias", "e_score_correction_bias", "running_mean", "running_var",
                           "num_batches_tracked", "position_ids", "token_type_ids", "inv_freq", "embed_avg",
                           "cluster_size", "inited", "relative_position_index", "empty_weight", "layer_scalar"})


def _buffer_values(headers: list) -> int:
    """The elements of stored tensors that are buffers by their leaf name (:data:`BUFFER_LEAVES`)."""
    return sum(ti.numel for h in headers for name, ti in h.tensors.items() if name.rsplit(".", 1)[-1] in BUFFER_LEAVES)


def _totals(ctx: Context, shown: str, meta: dict[str, Any], reads: dict[str, WeightsRead], shards: list[str]) -> None:
    complete = set(shards) <= set(reads) and all(r.header is not None and r.header.ok for r in reads.values())
    headers = [r.header for r in reads.values() if r.header is not None]
    if "total_size" not in meta:
        ctx.add("index.total_size_missing", WARNING, shown, f"{shown}: metadata has no total_size", _REPAIR)
    elif as_int(meta["total_size"]) is None:
        ctx.add("index.total_size_mismatch", ERROR, shown, f"{shown}: total_size is {meta['total_size']!r}, "
                "not an integer", _REPAIR)
    elif complete and (actual := sum(h.data_bytes for h in headers)) != meta["total_size"]:
        ctx.add("index.total_size_mismatch", ERROR, shown,
                f"{shown}: total_size is {meta['total_size']:,} but the shards hold {actual:,} tensor bytes",
                _REPAIR, stated=meta["total_size"], actual=actual)
    params = as_int(meta.get("total_parameters"))
    if params is not None and complete:
        actual_p = sum(h.tensors.numel for h in headers)
        if actual_p != params and actual_p - _buffer_values(headers) != params:
            ctx.add("index.total_parameters_mismatch", WARNING, shown,
                    f"{shown}: total_parameters is {params:,} but the shards hold {actual_p:,} values",
                    "harmless for loading, but the Hub shows the wrong model size; " + _REPAIR,
                    stated=params, actual=actual_p)
