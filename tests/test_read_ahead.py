"""The index read by a worker process beside the shard headers (ckptctl.worker, format.read_ahead,
layout.scan): the worker's protocol, the headers read ahead, and the same findings, inspections
and repairs with and without it, over the whole verify corpus and through the real CLI.

Everything that forks runs in a fresh interpreter (a subprocess): the test process may hold
threads from torch, and the worker refuses to fork beside a thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckptctl.errors import InputError
from ckptctl.format import read_ahead
from ckptctl.format.header import read_header, read_header_ahead
from ckptctl.format.index import encode_index, read_for_worker, read_index
from tests.support import REPO, run_cli_subprocess

TESTS = Path(__file__).resolve().parent


def _python(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Run ``code`` in a fresh interpreter (the repository and tests/ importable); its stdout."""
    full = {k: v for k, v in os.environ.items() if k != "CKPTCTL_WORKERS"}
    # OpenBLAS starts a thread pool when numpy is imported (the corpus builds with numpy): one
    # thread keeps the process single-threaded, as the CLI is, so that the worker may fork
    full.update({"PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OPENBLAS_NUM_THREADS": "1",
                 **(env or {})})
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       env=full, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


# --------------------------------------------------------------------------------------------
# the worker


def test_worker_returns_the_call_result_and_refuses_what_it_cannot_deliver() -> None:
    out = _python("""
        import json, os, threading, time
        from ckptctl import worker as W
        assert W.available()
        job = W.start(os.getpid, capacity=1 << 16)
        child = job.result()
        assert child != os.getpid() and job.pid is None and job.shared is None
        # the result did not wait for the child's exit: it is collected later, and at exit
        W._reap(block=True)
        assert W._ending == []
        try:
            os.waitpid(child, os.WNOHANG)
            raise AssertionError("the child was not collected")
        except ChildProcessError:
            pass
        failed = []
        for fn, cap in ((lambda: 1 / 0, 1 << 16), (lambda: b"x" * 100_000, 1000)):
            job = W.start(fn, capacity=cap)
            try:
                job.result()
            except W.WorkerFailed:
                failed.append(True)
        # the parent's own descriptors are closed in the child: a lock it holds stays its own
        extra = os.dup2(os.open(os.devnull, os.O_RDONLY), 500)  # above what the child's listdir takes
        fds = W.start(lambda: sorted(map(int, os.listdir("/proc/self/fd"))), capacity=1 << 16).result()
        # a parent interrupted in its own work kills and reaps the child
        job = W.start(time.sleep, 30, capacity=1 << 16)
        pid = job.pid
        try:
            with job:
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        try:
            os.waitpid(pid, os.WNOHANG)
            reaped = False
        except ChildProcessError:
            reaped = True
        # never beside another thread
        t = threading.Thread(target=time.sleep, args=(1,)); t.start()
        beside_thread = W.available()
        t.join()
        print(json.dumps({"failed": failed, "extra_in_child": extra in fds, "reaped": reaped,
                          "beside_thread": beside_thread}))
    """)
    got = json.loads(out)
    assert got == {"failed": [True, True], "extra_in_child": False, "reaped": True, "beside_thread": False}


def test_workers_off_by_environment() -> None:
    out = _python("from ckptctl import worker as W; print(W.available(), W.start(int, capacity=64))",
                  env={"CKPTCTL_WORKERS": "0"})
    assert out.split() == ["False", "None"]


# --------------------------------------------------------------------------------------------
# headers read ahead


def _shard(path: Path, names: list[str], value: float = 0.0) -> None:
    save_file({n: np.full((2, 2), value, dtype=np.float32) for n in names}, str(path), metadata={"format": "pt"})


def test_a_header_read_ahead_is_handed_out_once_and_only_for_the_same_file(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    _shard(p, ["a", "b"])
    # outside a scope nothing is kept
    read_header_ahead(p)
    assert read_header(p) is not read_header(p)
    with read_ahead.scope(tmp_path):
        assert read_ahead.wanted(tmp_path) and not read_ahead.wanted(tmp_path / "other")
        read_header_ahead(p)
        first = read_header(p, display=str(p))
        assert list(first.tensors) == ["a", "b"]
        assert read_header(p, display=str(p)) is not first  # handed out once
        # rewritten after it was read ahead (same size): the new bytes are parsed
        read_header_ahead(p)
        before = os.stat(p).st_mtime_ns
        _shard(p, ["a", "c"])
        os.utime(p, ns=(before + 1_000_000, before + 1_000_000))
        assert list(read_header(p, display=str(p)).tensors) == ["a", "c"]
        # another display (the findings name the file as the caller shows it) is another read
        read_header_ahead(p)
        assert read_header(p, display="shown").path == "shown"
    assert not read_ahead._kept


def test_an_index_read_for_a_worker_carries_joins_and_parses_its_map_on_demand(tmp_path: Path) -> None:
    wm = {"b.x": "s2", "a.y": "s1", "a.x": "s1"}
    (tmp_path / "i.json").write_bytes(encode_index(wm, 48))
    doc = read_for_worker(str(tmp_path / "i.json"), "shown")
    assert doc.joins == {"s1": "a.x\na.y", "s2": "b.x"} and doc.shards == ["s1", "s2"] and doc._map is None
    assert doc.weight_map == read_index(tmp_path / "i.json").weight_map == wm
    # the worker keeps no bytes: the map is read again, from the same file or one that says the same
    for again in (read_for_worker(str(tmp_path / "i.json"), "shown") for _ in range(2)):
        assert again._raw is None
        (tmp_path / "i.json").write_bytes(encode_index(wm, 48))  # rewritten, the same text
        assert again.weight_map == wm
    changed = read_for_worker(str(tmp_path / "i.json"), "shown")
    (tmp_path / "i.json").write_bytes(encode_index({**wm, "c": "s2"}, 48))
    with pytest.raises(InputError, match="changed while ckptctl was reading it"):
        changed.weight_map
    # a name holding a newline: no joins (they could not tell its names apart)
    (tmp_path / "n.json").write_bytes(encode_index({"a\nb": "s1", "a": "s1"}, 32))
    assert read_for_worker(str(tmp_path / "n.json"), "n").joins is None


# --------------------------------------------------------------------------------------------
# the same results with and without the worker


PARITY = """
import json, os, re, sys, hashlib
from pathlib import Path
import corpus
import ckptctl.worker as W
import ckptctl.layout
import ckptctl.format.index as FI
from ckptctl.errors import CkptctlError
from ckptctl.inspect import inspect_path
from ckptctl.resave import resave
from ckptctl.sizes import parse_size
from ckptctl.verify import VerifyOptions, verify_paths
from ckptctl.write.options import ExportOptions

PF = sys.modules["ckptctl.layout.prefetch"]
PF.READ_AHEAD_INDEX_BYTES = 0  # every index, however small, is read by a worker
jobs = 0
start = PF.start
def counting(*a, **k):
    global jobs
    job = start(*a, **k)
    jobs += job is not None
    return job
PF.start = counting
root = Path(sys.argv[1])

def tree(d):  # what each file holds, with the run's own directory written as P
    here = str(d.parent).encode()
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes().replace(here, b"P")).hexdigest()
            if p.is_file() else "other" for p in sorted(d.rglob("*")) if not p.is_symlink()}

def outcome(fn, d):
    PF._last = FI._last_read = None  # each command reads the index itself (by its own worker)
    try:
        out = fn(d)
    except CkptctlError as exc:
        out = {"error": type(exc).__name__, "message": exc.message, "hint": exc.hint}
    text = json.dumps(out, default=str).replace(str(d), "D").replace(str(d.parent), "P")
    return json.loads(re.sub(r"[.][0-9a-f]{16}-[0-9a-f]{8}", ".STAGING", text))  # a staging directory's own name

def run(case, d):
    opts = VerifyOptions(deep=case.deep, max_shard_size=parse_size(case.args[-1]) if "--max-shard-size" in case.args else None)
    got = {"verify": outcome(lambda p: verify_paths([str(p)], options=opts).to_dict(), d),
           "inspect": outcome(lambda p: inspect_path(p).to_dict(), d)}
    res = outcome(lambda p: resave(p, ExportOptions(), repair=True).to_dict(), d)
    if isinstance(res, dict):
        res.pop("seconds", None)
    got["resave"], got["after"] = res, tree(d)
    return got

assert W.available()
cases = list(corpus.CASES) + [corpus.Case("clean_" + k, fn) for k, fn in corpus.CLEAN.items()]
differ, made = [], 0
for case in cases:
    results = []
    for workers in ("0", "1"):
        # each run gets the case made afresh (the builders are seeded), under the same name
        d = root / case.name / workers / "ck"
        d.mkdir(parents=True)
        case.make(d)
        os.environ["CKPTCTL_WORKERS"] = workers
        FI._last_read = None  # each run reads the index itself
        results.append(run(case, d))
    if not any(p.name.endswith(".index.json") for p in d.iterdir()):
        continue
    made += 1
    if results[0] != results[1]:
        differ.append({"case": case.name, "serial": results[0], "worker": results[1]})
print(json.dumps({"made": made, "jobs": jobs, "differ": differ}))
"""


def test_verify_inspect_and_resave_are_the_same_with_the_worker_over_the_corpus(tmp_path: Path) -> None:
    got = json.loads(_python(PARITY, str(tmp_path)))
    assert got["made"] >= 30, got
    # each case reads its index three times with the worker (verify, inspect, resave's scans)
    assert got["jobs"] >= 3 * got["made"], got
    assert got["differ"] == [], json.dumps(got["differ"][0], indent=1)[:6000]


def _large(d: Path, *, shards: int = 8, per_shard: int = 1600) -> None:
    """A checkpoint whose index is over 1 MiB (12,800 tensors): the CLI reads it with a worker."""
    d.mkdir()
    wm: dict[str, str] = {}
    total = 0
    for s in range(1, shards + 1):
        name = f"model-{s:05d}-of-{shards:05d}.safetensors"
        names = [f"model.layers.{s}.mlp.experts.{i}.a_rather_long_projection_name.weight" for i in range(per_shard)]
        _shard(d / name, names, float(s))
        wm.update(dict.fromkeys(names, name))
        total += 16 * per_shard
    (d / "model.safetensors.index.json").write_bytes(encode_index(wm, total))
    assert (d / "model.safetensors.index.json").stat().st_size > 1 << 20


@pytest.mark.parametrize("command", [("verify", "--json"), ("inspect", "--json")])
def test_the_cli_gives_the_same_document_with_and_without_the_worker(tmp_path: Path, command: tuple[str, ...]) -> None:
    d = tmp_path / "big"
    _large(d)
    runs = [run_cli_subprocess(command[0], d, *command[1:], env={**os.environ, "CKPTCTL_WORKERS": w})
            for w in ("0", "1")]
    assert runs[0][0] == runs[1][0] == 0, runs[1][2]
    assert json.loads(runs[0][1]) == json.loads(runs[1][1])


def _moved(wm: dict[str, str]) -> None:
    wm[next(iter(wm))] = "model-00002-of-00008.safetensors"


def _dropped(wm: dict[str, str]) -> None:
    del wm[next(iter(wm))]


def _invented(wm: dict[str, str]) -> None:
    wm["model.not.stored.weight"] = "model-00003-of-00008.safetensors"


@pytest.mark.parametrize("edit, code", [(_moved, "index.wrong_shard"), (_dropped, "index.tensor_not_indexed"),
                                        (_invented, "index.tensor_missing")], ids=["moved", "dropped", "invented"])
def test_the_cli_reports_a_wrong_index_the_same_with_the_worker(tmp_path: Path, edit, code: str) -> None:
    d = tmp_path / "big"
    _large(d)
    idx = d / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    edit(doc["weight_map"])
    idx.write_text(json.dumps(doc, indent=2))
    runs = [run_cli_subprocess("verify", d, "--json", env={**os.environ, "CKPTCTL_WORKERS": w}) for w in ("0", "1")]
    assert runs[0][0] == runs[1][0] == 1
    docs = [json.loads(r[1]) for r in runs]
    assert docs[0] == docs[1]
    assert {f["code"] for f in docs[1]["results"][0]["findings"] if f["severity"] == "error"} == {code}


def test_a_split_keeps_every_shard_header_once_whoever_parsed_it(tmp_path: Path) -> None:
    """The worker takes shards from the back, this process from the front, each claiming one in
    shared memory before it parses it: every header is kept, the index comes back with joins."""
    d = tmp_path / "big"
    _large(d)
    out = _python("""
        import json, sys
        from pathlib import Path
        from ckptctl.format import read_ahead
        from ckptctl.layout import prefetch
        d = Path(sys.argv[1])
        shards = sorted(p.name for p in d.glob("*.safetensors"))
        with read_ahead.scope(d):
            split = prefetch.Split.start(d, "model.safetensors.index.json", shards)
            doc = split.finish()
            kept = sorted(k[0] for k in read_ahead._kept)
        print(json.dumps({"kept": kept, "joins": sorted(doc.joins), "ok": doc.ok, "path": doc.path}))
    """, str(d))
    got = json.loads(out)
    shards = sorted(str(p) for p in d.glob("*.safetensors"))
    assert got["kept"] == shards
    assert got["joins"] == sorted(Path(s).name for s in shards) and got["ok"]
    assert got["path"] == str(d / "model.safetensors.index.json")


def test_an_index_truncated_under_the_workers_mapping_ends_only_the_worker(tmp_path: Path) -> None:
    """The worker maps the index: a file truncated under the mapping ends it with SIGBUS (its
    parent never touches the mapping), and the parent reads the index itself."""
    d = tmp_path / "big"
    _large(d)
    out = _python("""
        import json, os, sys
        from pathlib import Path
        from ckptctl.format import index_text, read_ahead
        from ckptctl.layout import prefetch
        d = Path(sys.argv[1])
        index = d / "model.safetensors.index.json"
        real = index_text.joins_of
        def truncated(buf):  # in the worker, with the file mapped: the pages go away
            os.truncate(index, 0)
            return real(buf)
        index_text.joins_of = truncated
        shards = sorted(p.name for p in d.glob("*.safetensors"))
        with read_ahead.scope(d):
            split = prefetch.Split.start(d, index.name, shards)
            got = split.finish()
        print(json.dumps({"worker": split is not None, "read": got is not None, "size": index.stat().st_size}))
    """, str(d))
    assert json.loads(out) == {"worker": True, "read": False, "size": 0}


def test_the_config_rules_find_the_same_with_the_worker(tmp_path: Path) -> None:
    """Missing experts and layers on a checkpoint whose index a worker reads: the same findings
    as without it (the config rules run on the merged headers the worker and this process read)."""
    d = tmp_path / "big"
    _large(d)
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                               "num_hidden_layers": 10, "n_routed_experts": 1601}))
    runs = [run_cli_subprocess("verify", d, "--json", env={**os.environ, "CKPTCTL_WORKERS": w}) for w in ("0", "1")]
    assert runs[0][0] == runs[1][0] == 1, runs[1][2]
    docs = [json.loads(r[1]) for r in runs]
    assert docs[0] == docs[1]
    codes = {f["code"] for f in docs[1]["results"][0]["findings"]}
    assert {"config.expert_missing", "config.layer_missing"} <= codes


def test_the_config_rules_take_the_workers_facts_only_where_the_index_agrees(tmp_path: Path) -> None:
    """The worker works out the expert blocks, layer stacks and layout from the index's names:
    this process then never walks the names for them, unless the index maps other names than
    the shards hold (then it does, over the headers). The findings are the same either way."""
    d = tmp_path / "big"
    _large(d)
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                               "num_hidden_layers": 10, "n_routed_experts": 1601}))
    code = """
        import json, os, sys
        from ckptctl.verify import VerifyOptions, model, stacks, verify_paths
        parent, calls = os.getpid(), []
        def counted(fn):
            def wrapper(*a, **k):
                if os.getpid() == parent:  # the worker's calls are its own
                    calls.append(fn.__name__)
                return fn(*a, **k)
            return wrapper
        for mod in (model, stacks):
            for name in ("expert_blocks", "containers", "_detect"):
                if hasattr(mod, name):
                    setattr(mod, name, counted(getattr(mod, name)))
        doc = verify_paths([sys.argv[1]], options=VerifyOptions()).to_dict()
        print(json.dumps({"calls": sorted(set(calls)), "findings": doc["results"][0]["findings"]}))
    """
    runs = {w: json.loads(_python(code, str(d), env={"CKPTCTL_WORKERS": w})) for w in ("0", "1")}
    assert runs["1"]["calls"] == [] and runs["0"]["calls"] == ["_detect", "containers", "expert_blocks"]
    assert runs["1"]["findings"] == runs["0"]["findings"]
    assert {"config.expert_missing", "config.layer_missing"} <= {f["code"] for f in runs["1"]["findings"]}
    # an index that maps a name to another shard: the rules walk the headers' names themselves
    idx = d / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    _moved(doc["weight_map"])
    idx.write_text(json.dumps(doc, indent=2))
    moved = {w: json.loads(_python(code, str(d), env={"CKPTCTL_WORKERS": w})) for w in ("0", "1")}
    assert moved["1"]["calls"] == ["_detect", "containers", "expert_blocks"]
    assert moved["1"]["findings"] == moved["0"]["findings"]
    assert "index.wrong_shard" in {f["code"] for f in moved["1"]["findings"]}


def test_a_second_scan_of_the_same_index_reuses_its_reading(tmp_path: Path) -> None:
    """export scans its source twice: the index a split read is read again only when the file
    changed (its fstat identity)."""
    d = tmp_path / "big"
    _large(d)
    out = _python("""
        import json, os, sys
        from pathlib import Path
        from ckptctl.format import read_ahead
        from ckptctl.layout import prefetch
        started = []
        real = prefetch.start
        prefetch.start = lambda *a, **k: started.append(1) or real(*a, **k)
        d = Path(sys.argv[1])
        shards = sorted(p.name for p in d.glob("*.safetensors"))
        index = "model.safetensors.index.json"
        with read_ahead.scope(d):
            first = prefetch.take(d, index, shards)
            again = prefetch.take(d, index, shards)
            (d / index).write_bytes((d / index).read_bytes())  # rewritten: a new ctime
            changed = prefetch.take(d, index, shards)
        print(json.dumps({"started": len(started), "same": first.joins == again.joins == changed.joins}))
    """, str(d))
    assert json.loads(out) == {"started": 2, "same": True}
