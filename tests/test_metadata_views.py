"""The whole-collection shortcuts verify and repair take at 90k tensors give what the long way
gives: several files' tensors merged as a view of their tables (against the dict ``update`` made
of them), and the index cross-check decided by comparing two dicts (against the per-shard sets
it replaced). Each case mixes the oddities the shortcuts must not lose: a name stored in two
files, a name holding a newline, an unreadable shard, an index naming a shard that is not read."""

from __future__ import annotations

import json
import random
import struct
from operator import attrgetter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.format.header import MergedSpecs, parse_header_bytes
from ckptctl.format.tensor import TensorSpec, dtypes
from ckptctl.verify.context import WeightsRead
from ckptctl.format.index import Index, parse_index, worker_reading

NAMES = ["a", "b.weight", "c\nd", "é", "x.experts.1.w", "__metadata__x", "z", " sp ace"]
DTYPES = ["BF16", "F32", "F8_E4M3", "U8"]


def _agrees(wm: dict[str, str], reads: dict[str, WeightsRead], shards: list[str]) -> bool:
    """verify's agreement check (``Index.agrees``, as ``verify/index.read_indexed`` asks it), by
    the index parsed here (its map) and as a worker hands it back (each shard's names joined;
    the map where a name holds a newline): both must answer the same."""
    raw = json.dumps({"metadata": {}, "weight_map": wm}, ensure_ascii=False).encode()
    here = Index("i")
    parse_index(here, raw)
    joined = Index.from_worker("i", raw, True, next(worker_reading(raw, "i", True, None)))
    readable = {s: r.names for s, r in reads.items() if r.names is not None}
    whole = readable.keys() >= set(shards)
    answers = {idx.agrees(readable, whole=whole) for idx in (here, joined)}
    assert len(answers) == 1
    return answers.pop()


def _header(specs: list[TensorSpec]):
    """A real header's table (the view verify merges), written canonically."""
    obj, offset = {"__metadata__": {"format": "pt"}}, 0
    for s in specs:
        obj[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    hdr = parse_header_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    assert hdr.ok, hdr.findings
    return hdr.tensors.specs()


def _parts(rng: random.Random, overlap: bool) -> list:
    pool = NAMES + [f"model.layers.{i}.w" for i in range(12)]
    rng.shuffle(pool)
    parts, start = [], 0
    for k in range(rng.randint(1, 4)):
        take = rng.randint(0, 6)
        names = pool[start:start + take]
        if overlap and start and rng.random() < 0.7:
            names = names + [pool[rng.randrange(start)]]  # a name an earlier part holds
        start += take
        specs = [TensorSpec(n, rng.choice(DTYPES), (rng.randint(1, 3), 2)) for n in names]
        parts.append(_header(specs) if k % 2 == 0 else {s.name: s for s in specs})  # a header, a pickle's dict
    return parts


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_merged_view_reads_as_the_updated_dict(seed: int, overlap: bool) -> None:
    parts = _parts(random.Random(seed), overlap)
    merged, slow = MergedSpecs(parts), {}
    for p in parts:
        slow.update(p.items())
    assert list(merged) == list(slow) and len(merged) == len(slow)
    assert list(merged.items()) == list(slow.items())
    assert list(merged.values()) == list(slow.values())
    assert set(merged.keys()) == set(slow) and merged == slow
    assert all(merged[n] == slow[n] and n in merged for n in slow)
    assert "nope" not in merged and [] not in merged
    assert dtypes(merged) == set(map(attrgetter("dtype"), slow.values()))
    for p in parts:  # a header's table answers from its columns, as its specs would
        assert dtypes(p) == set(map(attrgetter("dtype"), p.values()))


def test_an_overlapping_name_is_the_last_parts() -> None:
    first = _header([TensorSpec("w", "F32", (2,)), TensorSpec("u", "U8", (1,))])
    second = {"w": TensorSpec("w", "BF16", (3,))}
    merged = MergedSpecs([first, second])
    assert list(merged) == ["w", "u"] and merged["w"].dtype == "BF16"
    assert dtypes(merged) == {"BF16", "U8"}  # the overridden F32 is stored nowhere that counts


def _by_shard_sets(wm: dict[str, str], reads: dict[str, WeightsRead]) -> bool:
    """The check as it was written first: each readable shard's names against the index's set for it."""
    by_shard: dict[str, set[str]] = {}
    for t, shard in wm.items():
        by_shard.setdefault(shard, set()).add(t)
    return all(r.names is None or set(r.names) == by_shard.get(s, set()) for s, r in reads.items())


@pytest.mark.parametrize("seed", range(300))
def test_index_agreement_by_dicts_is_the_per_shard_sets(seed: int) -> None:
    rng = random.Random(seed)
    shards = [f"s{i}" for i in range(rng.randint(1, 4))]
    names = NAMES + [f"t{i}" for i in range(6)]
    held = {s: set() for s in shards}
    for n in names:
        held[rng.choice(shards)].add(n)
    wm = {n: s for s, ns in held.items() for n in ns}
    reads = {s: WeightsRead(set(ns), {}) for s, ns in held.items()}
    for _ in range(rng.randint(0, 3)):  # the damage a checkpoint may have
        kind, s = rng.randrange(6), rng.choice(shards)
        if s not in reads:
            continue
        if kind == 0:
            reads[s].names = None  # unreadable
        elif kind == 1:
            wm[rng.choice(names)] = rng.choice(shards)  # mapped to another shard
        elif kind == 2 and reads[s].names is not None:
            reads[s].names.add(rng.choice(names))  # stored twice
        elif kind == 3:
            wm[f"ghost{rng.randrange(3)}"] = rng.choice(shards + ["elsewhere.safetensors"])
        elif kind == 4:
            del reads[s]  # not read at all (missing)
        elif kind == 5 and reads[s].names is not None:
            reads[s].names.add("not-indexed")
    index_shards = sorted(set(wm.values()))
    assert _agrees(wm, reads, index_shards) == _by_shard_sets(wm, reads)


def test_index_agreement_sees_both_answers() -> None:
    """The fuzz above is not one-sided: a sound set agrees, each kind of damage does not."""
    wm = {"a": "s1", "b": "s2", "c\nd": "s2"}
    good = {"s1": WeightsRead({"a"}, {}), "s2": WeightsRead({"b", "c\nd"}, {})}
    assert _agrees(wm, good, ["s1", "s2"]) and _by_shard_sets(wm, good)
    twice = {"s1": WeightsRead({"a", "b"}, {}), "s2": WeightsRead({"b", "c\nd"}, {})}
    assert not _agrees(wm, twice, ["s1", "s2"])
    moved = {"s1": WeightsRead({"a", "b"}, {}), "s2": WeightsRead({"c\nd"}, {})}
    assert not _agrees(wm, moved, ["s1", "s2"])
    unread = {"s1": WeightsRead(None, {}), "s2": WeightsRead({"b", "c\nd"}, {})}
    assert _agrees(wm, unread, ["s1", "s2"])  # an unreadable shard is reported elsewhere
    assert not _agrees(wm, {"s1": WeightsRead(None, {}), "s2": WeightsRead({"b"}, {})}, ["s1", "s2"])


def test_a_tables_records_by_column_are_its_records_by_name() -> None:
    """values()/items() are made by C loops over the columns; a look-up by name makes each one
    from its row: the same records, in the same order (an empty table too)."""
    specs = [TensorSpec(n, DTYPES[i % 4], (i % 3 + 1, 2)) for i, n in enumerate(NAMES)]
    for view in (_header(specs), _header([])):
        table = view._table
        assert list(table.values()) == [table[n] for n in table]
        assert list(table.items()) == [(n, table[n]) for n in table]
        assert list(view.values()) == [table[n].spec for n in table] == [view[n] for n in view]
        assert list(view.items()) == [(n, view[n]) for n in view]
        assert list(table.keys()) == list(view.keys()) == [s.name for s in view.values()]


@pytest.mark.parametrize("name_filter", [None, "*.w", "nothing*"])
def test_inspect_counts_by_column_equal_counts_by_row(name_filter: str | None) -> None:
    """Every row shown (any order): the columns are counted as stored; the rows one by one give
    the same count, and so does a part of them."""
    from ckptctl.inspect import TensorRows

    rng = random.Random(7)
    rows = TensorRows()
    for f in range(3):
        specs = [TensorSpec(f"f{f}.{n}", rng.choice(DTYPES), (rng.randint(1, 3),)) for n in NAMES + ["x.w", "y.w"]]
        rows.add_table(_header(specs)._table, f"file{f}", None)
    rows.arrange(by_component=False, name_filter=name_filter)
    shown = list(rows._rows())
    assert rows.counts() == rows.counts(list(shown))  # a list is counted row by row
    assert rows.counts(range(len(rows._names))) == rows.counts(list(range(len(rows._names))))
    assert rows.counts(range(2, 9)) == rows.counts(list(range(2, 9)))
    single = TensorRows()
    single.add_table(_header([TensorSpec(n, "F32", (2,)) for n in NAMES])._table, "one", None)
    single.arrange(by_component=False, name_filter=name_filter)
    assert single.counts() == single.counts(list(single._rows()))


@pytest.mark.parametrize("seed", range(200))
def test_no_name_twice_by_the_merged_index_is_the_union_of_names(seed: int) -> None:
    """Whether a family stores a name twice: from the merged view's index when every file's
    names are its tensors', else from the union of the names (a pickle's aliases, a name only a
    finding mentions, an unreadable file)."""
    from ckptctl.verify.weights import _no_name_twice

    rng = random.Random(seed)
    reads = {}
    for f in range(rng.randint(2, 4)):
        names = set(rng.sample(NAMES, rng.randint(0, 4)))
        tensors = {n: TensorSpec(n, "F32", (1,)) for n in names}
        kind = rng.randrange(4)
        if kind == 0:
            reads[f"f{f}"] = WeightsRead(None, {})
            continue
        if kind == 1 and tensors:  # an alias (pickle) or a name a finding mentions (header)
            names.add(rng.choice(NAMES))
        view = _header(list(tensors.values())) if kind == 2 else tensors
        reads[f"f{f}"] = WeightsRead(set(view) | names if kind != 2 else view.keys(), view)
    merged = MergedSpecs([r.tensors for r in reads.values()])
    union = set().union(*(r.names or () for r in reads.values()))
    assert _no_name_twice(reads, merged) == (len(union) == sum(len(r.names or ()) for r in reads.values()))


@pytest.mark.parametrize("at_once", [1, 3, 4096])
def test_streamed_inspect_rows_are_json_dumps_bytes(capsys, monkeypatch, at_once: int) -> None:
    """inspect --json writes its rows a chunk at a time, each distinct object encoded once: the
    bytes ``json.dumps`` gives for the whole document, whatever the chunk size, with names json
    must escape (a quote, a backslash, control characters) and names it must not."""
    from ckptctl.cli import _output
    from ckptctl.cli._output import JsonRows, Output
    from ckptctl.inspect import TensorRows

    monkeypatch.setattr(_output, "_ROWS_AT_ONCE", at_once)

    odd = ['q"uote', "back\\slash", "new\nline", "tab\t", "nul\x00", "\x7f", "é", "\u2028", "<>&'", "\x1f"]
    rows = TensorRows()
    plain = [f"model.layers.{i}.w" for i in range(4096 + 5)]  # a whole chunk of plain names
    for i, n in enumerate(plain + odd + [f"z.{i}" for i in range(7)]):
        rows.add(TensorSpec(n, DTYPES[i % 4], (i % 3 + 1,)), f"f{i % 2}", "comp" if i % 5 == 0 else None)
    rows.arrange(by_component=False, name_filter=None)
    out = Output("inspect", json_mode=True)
    doc = out.document(True, path="x", note="é\n")
    encoded: list[str] = []
    encode = json.encoder.encode_basestring
    monkeypatch.setattr(json.encoder, "encode_basestring", lambda text: encoded.append(text) or encode(text))
    out.emit_json(doc, rows=JsonRows("tensors", *rows.columns()))
    # a chunk of names json does not escape is written as it is: a plain name is encoded one by
    # one only in a chunk that also holds a name json escapes
    assert len(set(encoded) & set(plain)) <= len(odd) * at_once
    monkeypatch.undo()
    expected = json.dumps({**doc, "tensors": list(rows.json_rows())}, ensure_ascii=False, default=str) + "\n"
    assert capsys.readouterr().out == expected


def test_inspect_restores_the_garbage_collector(tmp_path) -> None:
    """inspect pauses the collector while it reads the headers and streams its rows, then turns
    it back on (and leaves it off when it was off)."""
    import gc

    from tests.support import invoke, write_tiny_checkpoint

    d = write_tiny_checkpoint(tmp_path / "ckpt")
    assert gc.isenabled()
    for args in (("inspect", d), ("inspect", d, "--json")):
        assert invoke(*args).exit_code == 0
        assert gc.isenabled()
    gc.disable()
    try:
        assert invoke("inspect", d, "--json").exit_code == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_merged_table_keyed_by_file_maps_each_name_to_its_files_key() -> None:
    """``keys``: the index of every name holds each part's key (verify compares it with the
    checkpoint index's map as it is); look-ups still answer the part's record, the last part
    holding a name wins as without keys, and a key per part is required."""
    from ckptctl.format.table import MergedSpecs
    from ckptctl.format.tensor import TensorSpec

    a = {"x": TensorSpec("x", "F32", (1,)), "y": TensorSpec("y", "F32", (2,))}
    b = {"z": TensorSpec("z", "BF16", (3,)), "y": TensorSpec("y", "F16", (4,))}
    keyed = MergedSpecs([a, b], keys=["a.safetensors", "b.safetensors"])
    assert not keyed.disjoint
    assert keyed.keyed_index() == {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"}
    assert keyed["y"] is b["y"] and keyed["x"] is a["x"] and dict(keyed) == dict(MergedSpecs([a, b]))
    assert MergedSpecs([a, {"z": b["z"]}], keys=["a", "b"]).disjoint
    with pytest.raises(ValueError):
        MergedSpecs([a, b], keys=["a", "a"])
    with pytest.raises(AssertionError):
        MergedSpecs([a, b]).keyed_index()


@pytest.mark.parametrize("seed", range(50))
def test_a_merged_table_given_its_index_reads_as_the_one_it_builds(seed: int) -> None:
    """``where``: the index of names verify already holds (a weight_map that agrees with every
    shard), in the index's own order: the view reads exactly as the one that builds its index
    from the parts (names in the parts' order, records, length, membership)."""
    rng = random.Random(seed)
    parts = _parts(rng, overlap=False)
    keys = [f"s{i}.safetensors" for i in range(len(parts))]
    built = MergedSpecs(parts, keys=keys)
    assert built.disjoint
    where = dict(built.keyed_index())
    order = list(where)
    rng.shuffle(order)
    given = MergedSpecs(parts, keys=keys, where={n: where[n] for n in order})
    assert given.disjoint and list(given) == list(built) and len(given) == len(built)
    assert list(given.items()) == list(built.items()) and all(given[n] == built[n] for n in built)
    assert all(n in given for n in built) and "no such name" not in given and [] not in given
    with pytest.raises(KeyError):
        given["no such name"]
    with pytest.raises(ValueError):
        MergedSpecs(parts, where=where)


@pytest.mark.parametrize("seed", range(40))
def test_a_disjoint_merged_table_answers_by_name_as_the_dict_before_and_after_its_rows(seed: int) -> None:
    """``disjoint`` without an index (a worker's reading): look-ups by name search the headers'
    lists first, then (past ``SCANNED_LOOKUPS``) their rows, and ``get_many`` (``specs_of``)
    intersects each part's names: every way answers what the updated dict answers, missing
    names included, and the few first look-ups make no header's rows."""
    from ckptctl.format.table import SCANNED_LOOKUPS, specs_of

    rng = random.Random(seed)
    parts = _parts(rng, overlap=False)
    slow: dict = {}
    for p in parts:
        slow.update(p.items())
    merged = MergedSpecs(parts, disjoint=True)
    asked = list(slow) + ["nope", "model.layers.99.w"]
    rng.shuffle(asked)
    assert specs_of(merged, asked) == specs_of(slow, asked) == {n: slow[n] for n in asked if n in slow}
    firsts = asked[:SCANNED_LOOKUPS]
    assert [merged.get(n) for n in firsts] == [slow.get(n) for n in firsts]
    assert merged._lookups is None  # no header's rows made for them
    assert [merged.get(n) for n in asked] == [slow.get(n) for n in asked]  # past the scans: the rows
    assert merged._lookups is not None or len(asked) <= SCANNED_LOOKUPS
    assert merged.get_many(asked) == specs_of(slow, asked)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",)) | st.sampled_from('"\\\n\t\x00\x1f\x7fé\u2028'),
                        max_size=6), min_size=1, max_size=5))
def test_a_chunk_of_names_is_plain_exactly_when_json_writes_each_as_it_is(names: list[str]) -> None:
    """``_plain``: no name of the chunk needs an escape in JSON (``json.dumps`` with
    ``ensure_ascii=False`` writes it between quotes as it is), and only then."""
    from ckptctl.cli._output import _plain

    expected = all(json.dumps(n, ensure_ascii=False) == f'"{n}"' for n in names)
    assert _plain("\n".join(names), len(names)) is expected


def test_get_many_answers_alike_for_a_few_and_for_many_names_of_one_header() -> None:
    """``get_many`` finds a few names of a header by a search of its list, more (past
    ``SCANNED_LOOKUPS``) by its rows: the same specs either way."""
    from ckptctl.format.table import SCANNED_LOOKUPS

    specs = [TensorSpec(f"model.layers.{i}.w", DTYPES[i % 4], (i % 3 + 1, 2)) for i in range(3 * SCANNED_LOOKUPS)]
    header, other = _header(specs), {"x": TensorSpec("x", "F32", (1,))}
    for wanted in ([s.name for s in specs[:2]], [s.name for s in specs] + ["x", "nope"]):
        merged = MergedSpecs([header, other], disjoint=True)
        assert merged.get_many(wanted) == {n: s for s in [*specs, other["x"]] if (n := s.name) in wanted}
