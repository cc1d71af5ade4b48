"""A large index parsed by a forked worker (``MetadataReading``, fast path ``index-worker``)
while the command decodes the headers ahead: the worker hands back each shard's names (the map
is parsed here only when asked for) and, for verify's reading, the config rules' facts of the
names (expert blocks, layer stacks, the layout), used only where the index names exactly the
tensors. Judged by what it must equal: the map and the agreement the index parsed here gives,
the facts the rules work out from the tensor table, and each command's output byte for byte
with the worker off."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckptctl.format.index import encode_index
from ckptctl.format.index import Index, parse_index, worker_reading
from ckptctl.layout.reading import WORKER_FROM
from ckptctl.tensor_names import TensorNames
from ckptctl.verify import model, stacks

LAYERS, EXPERTS, SHARDS, HIDDEN, VOCAB = 2, 2000, 4, 4, 16
INDEX = "model.safetensors.index.json"


def _mixtral_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
                                          "lm_head.weight": (VOCAB, HIDDEN)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        for proj in "qkvo":
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (HIDDEN, HIDDEN)
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
        shapes[p + "block_sparse_moe.gate.weight"] = (EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            for w in ("w1", "w2", "w3"):
                shapes[f"{p}block_sparse_moe.experts.{e}.{w}.weight"] = (HIDDEN, HIDDEN)
    return shapes


CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
          "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 1,
          "num_key_value_heads": 1, "vocab_size": VOCAB, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
          "tie_word_embeddings": False, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mixtral of 12k tensors in SHARDS shards (an index of over WORKER_FROM bytes), its
    index and config."""
    d = tmp_path_factory.mktemp("index-worker") / "moe"
    d.mkdir()
    shapes = _mixtral_shapes()
    names = sorted(shapes)
    wm, total, per = {}, 0, -(-len(names) // SHARDS)
    for k in range(SHARDS):
        shard = f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {n: np.zeros(shapes[n], np.float32) for n in names[k * per:(k + 1) * per]}
        save_file(part, str(d / shard), metadata={"format": "pt"})
        wm.update(dict.fromkeys(part, shard))
        total += sum(a.nbytes for a in part.values())
    (d / INDEX).write_bytes(encode_index(wm, total))
    assert (d / INDEX).stat().st_size >= WORKER_FROM
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def _variant(moe: Path, tmp_path: Path, case: str) -> Path:
    d = tmp_path / case
    d.mkdir(parents=True)
    for n in os.listdir(moe):
        os.link(moe / n, d / n)
    if case == "expert-missing":  # the config counts more experts than are stored
        os.unlink(d / "config.json")
        (d / "config.json").write_text(json.dumps({**CONFIG, "num_local_experts": EXPERTS + 3}))
    elif case == "index-disagrees":  # one name mapped to a shard that does not hold it: no facts used
        doc = json.loads((moe / INDEX).read_text())
        wm = doc["weight_map"]
        wm["model.layers.1.block_sparse_moe.experts.7.w1.weight"] = "model-00001-of-00004.safetensors"
        os.unlink(d / INDEX)
        (d / INDEX).write_bytes(encode_index(wm, doc["metadata"]["total_size"]))
    elif case == "hostile-folder":  # what the worker's reading ahead must pass by: a FIFO, links
        os.mkfifo(d / "model-00000-of-00004.safetensors")
        os.symlink("/dev/zero", d / "zz-a.safetensors")
        os.symlink(moe / "model-00001-of-00004.safetensors", d / "zz-b.safetensors")
    return d


def _run(worker: str, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "CKPTCTL_FAST_INDEX_WORKER": worker}
    proc = subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


CASES = ["clean", "expert-missing", "index-disagrees", "hostile-folder"]


@pytest.mark.parametrize("case", CASES)
def test_verify_says_the_same_with_and_without_the_worker(moe: Path, tmp_path: Path, case: str) -> None:
    d = _variant(moe, tmp_path, case)
    args = ("verify", str(d), "--static", "--json")
    with_worker, without = _run("1", *args), _run("0", *args)
    assert with_worker[:2] == without[:2]
    codes = {f["code"] for r in json.loads(without[1])["results"] for f in r["findings"]}
    expected = {"clean": set(), "expert-missing": {"config.expert_missing"},
                "index-disagrees": {"index.wrong_shard"}, "hostile-folder": set()}[case]
    assert expected <= codes and (case != "clean" or without[0] == 0)


@pytest.mark.parametrize("case", CASES)
def test_inspect_says_the_same_with_and_without_the_worker(moe: Path, tmp_path: Path, case: str) -> None:
    d = _variant(moe, tmp_path, case)
    with_worker, without = _run("1", "inspect", str(d), "--json"), _run("0", "inspect", str(d), "--json")
    assert with_worker[:2] == without[:2] and without[0] == 0


@pytest.mark.parametrize("case", ["clean", "index-disagrees"])
def test_a_repair_does_the_same_with_and_without_the_worker(moe: Path, tmp_path: Path, case: str) -> None:
    """A no-op repair writes nothing either way; a repair of a stale index rebuilds the same one."""
    outcomes = []
    for worker in ("1", "0"):
        d = _variant(moe, tmp_path / worker, case)
        before = {n: (d / n).stat().st_ino for n in os.listdir(d)}
        code, out, err = _run(worker, "resave", "--repair", str(d), "--static", "--json")
        after = {n: (d / n).stat().st_ino for n in os.listdir(d)}
        outcomes.append((code, json.loads(out).get("fixes"), (d / INDEX).read_bytes(), before == after))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][3] == (case == "clean")  # only the stale index is rewritten


def test_the_worker_draws_the_facts_verify_uses(moe: Path) -> None:
    """In a fresh interpreter (no torch, no thread: a fork is safe) the reading's worker delivers
    the facts, and check_config is handed them."""
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from ckptctl import worker
        from ckptctl.layout.reading import MetadataReading
        from ckptctl.verify import VerifyOptions, verify_path
        from ckptctl.verify import model
        handed = []
        check = model.check_config
        def spy(*args, **kwargs):
            handed.append(kwargs.get("facts") is not None)
            return check(*args, **kwargs)
        model.check_config = spy
        reading = MetadataReading(names_work=model.name_facts, workers=True)
        verify_path(Path({str(moe)!r}), options=VerifyOptions(static=True, reading=reading))
        print(json.dumps([worker.available(), handed]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    available, handed = json.loads(proc.stdout)
    if not available:
        pytest.skip("no fork here: fewer than two CPUs in the affinity mask")
    assert handed == [True]


def _names_sets() -> dict[str, list[str]]:
    llama = [f"model.layers.{i}.{t}.weight" for i in range(3) for t in ("self_attn.q_proj", "mlp.up_proj")]
    llama += ["model.embed_tokens.weight", "lm_head.weight"]
    t5 = [f"{s}.block.{i}.layer.{j}.SelfAttention.q.weight" for s in ("encoder", "decoder") for i in range(2)
          for j in range(2)] + ["shared.weight"]
    deepseek = [f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" for i in range(1, 3) for e in range(5)]
    deepseek += [f"model.layers.{i}.mlp.shared_experts.up_proj.weight" for i in range(3)]
    deepseek += ["model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"]
    gpt2 = [f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)] + ["transformer.wte.weight"]
    return {"mixtral": sorted(_mixtral_shapes()), "llama": llama, "t5": t5, "deepseek": deepseek, "gpt2": gpt2}


@pytest.mark.parametrize("kind", sorted(_names_sets()))
def test_the_names_facts_are_the_rules_own(kind: str) -> None:
    """name_facts of the names in one order equals what expert_blocks, containers and _detect work
    out from a table of the same names in another order."""
    names = _names_sets()[kind]
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    table = TensorNames(dict.fromkeys(shuffled))  # the rules read names only
    stacks.expert_blocks(table), stacks.containers(table)
    detected = model._detect(table)
    if detected is not None:  # the embedding and layer rules' names of the layout found
        model._layout_names(table, *detected)
    assert model.name_facts(names) == table.facts
    seeded = TensorNames(dict.fromkeys(shuffled))
    seeded.facts.update(model.name_facts(names) or {})
    assert (stacks.expert_blocks(seeded), stacks.containers(seeded), model._detect(seeded)) == \
        (stacks.expert_blocks(table), stacks.containers(table), model._detect(table))
    if detected is not None:
        assert model._layout_names(seeded, *detected) == model._layout_names(table, *detected)
    assert "text" not in seeded.__dict__  # every rule answered from the facts: the names never joined


def test_no_facts_where_a_name_holds_a_newline() -> None:
    assert model.name_facts(["model.layers.0.a\nb.weight", "model.embed_tokens.weight"]) is None


def _worker_index(raw: bytes, names_work=None) -> Index:
    """An index as a worker hands it back (its generator run here: the worker's call itself)."""
    steps = worker_reading(raw, "model.safetensors.index.json", True, names_work)
    read = next(steps)
    out = Index.from_worker("model.safetensors.index.json", raw, True, read)
    assert list(steps) == ([] if names_work is None else [names_work])
    return out


def test_a_worker_reading_parses_the_map_here_only_when_asked(moe: Path) -> None:
    raw = (moe / INDEX).read_bytes()
    here = Index("model.safetensors.index.json")
    parse_index(here, raw)
    got = _worker_index(raw)
    assert (got.findings, got.metadata, got.shards) == (here.findings, here.metadata, here.shards)
    assert got.parsed_map() is None and got.copy().parsed_map() is None
    assert got.copy().weight_map == here.weight_map and got.parsed_map() == here.shared_map


def test_a_worker_reading_agrees_as_the_map_does(moe: Path) -> None:
    """Index.agrees from each shard's joined names and from the map, over the ways a shard set
    can differ from what the index maps to it."""
    raw = (moe / INDEX).read_bytes()
    here = Index("i")
    parse_index(here, raw)
    groups: dict[str, list[str]] = {}
    for name, shard in here.shared_map.items():
        groups.setdefault(shard, []).append(name)
    first, second = sorted(groups)[:2]
    moved = {**groups, first: groups[first][1:], second: groups[second] + groups[first][:1]}
    cases = {
        "exact": groups,
        "shuffled": {s: sorted(n, reverse=True) for s, n in groups.items()},
        "a shard left out": {s: n for s, n in groups.items() if s != first},
        "a name missing": {**groups, first: groups[first][1:]},
        "a name invented": {**groups, first: groups[first] + ["model.invented.weight"]},
        "a name moved": moved,
        "a shard the index does not name": {**groups, "model-09999.safetensors": ["x"]},
        "an empty shard the index does not name": {**groups, "model-09999.safetensors": []},
        # names holding newlines, as many as the index maps there: joined, more lines than its text
        "two names fused by a newline": {**groups, first: ["\n".join(groups[first][:2]), *groups[first][2:], "z"]},
        "a name ending in a newline": {**groups, first: [groups[first][0] + "\n", *groups[first][1:]]},
        "an empty name": {**groups, first: ["", *groups[first][1:]]},
    }
    worker = _worker_index(raw)
    for what, held in cases.items():
        for whole in (True, False):
            assert worker.agrees(held, whole=whole) == here.agrees(held, whole=whole), (what, whole)
    assert worker.agrees(groups, whole=True) and not worker.agrees(moved, whole=False)


def test_headers_decoded_ahead_are_regular_files_within_the_budget(tmp_path: Path) -> None:
    """What the command decodes ahead while its worker parses an index: the folder's safetensors
    files by name, passing by links, FIFOs and hidden files, and none whose header would take the
    text decoded ahead past its budget (those are decoded when read, as without a worker)."""
    from ckptctl.layout.reading import MetadataReading, _safetensors_names

    d = tmp_path / "folder"
    d.mkdir()
    small = {"a": np.zeros((2,), np.float32)}
    large = {f"t{i}": np.zeros((1,), np.float32) for i in range(200)}
    save_file(small, str(d / "a-small.safetensors"))
    save_file(large, str(d / "b-large.safetensors"))
    save_file(small, str(d / "c-small.safetensors"))
    save_file(small, str(d / ".hidden.safetensors"))
    os.mkfifo(d / "d-fifo.safetensors")
    os.symlink(d / "a-small.safetensors", d / "e-link.safetensors")
    sizes = {n: int.from_bytes((d / n).read_bytes()[:8], "little") for n in ("a-small.safetensors",
                                                                            "b-large.safetensors")}
    reading = MetadataReading(workers=False)
    listed = _safetensors_names(str(d))
    assert listed == ["a-small.safetensors", "b-large.safetensors", "c-small.safetensors", "d-fifo.safetensors",
                      "e-link.safetensors"]  # not the hidden one
    reading._decode_ahead(str(d), listed, sizes["a-small.safetensors"] + sizes["b-large.safetensors"] - 1)
    ahead = sorted(h.path.rsplit("/", 1)[1] for entries in reading._ahead.values() for _, h in entries)
    assert ahead == ["a-small.safetensors", "c-small.safetensors"]  # b over the budget, the rest passed by
    got = reading.header(d / "a-small.safetensors", keep=False)
    assert got.ok and list(got.tensors) == ["a"]
    assert sum(map(len, reading._ahead.values())) == 1  # each decoded ahead is used once


def test_a_reading_that_asks_no_agreement_gets_no_joined_names_and_agrees_by_the_map(moe: Path) -> None:
    """inspect and an export ask no agreement (``MetadataReading(agreement=False)``): the worker
    hands back no names; an agreement asked anyway is answered from the map, parsed here."""
    raw = (moe / INDEX).read_bytes()
    read = next(worker_reading(raw, "i", True, None, False))
    assert read["joins"] is None
    here = Index("i")
    parse_index(here, raw)
    got = Index.from_worker("i", raw, True, read)
    groups: dict[str, list[str]] = {}
    for name, shard in here.shared_map.items():
        groups.setdefault(shard, []).append(name)
    assert got.parsed_map() is None
    assert got.agrees(groups, whole=True) and got.parsed_map() == here.shared_map
    first = sorted(groups)[0]
    assert not got.agrees({**groups, first: groups[first][1:]}, whole=True)
