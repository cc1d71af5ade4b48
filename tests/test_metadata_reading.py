"""The metadata reading (``ckptctl.layout.reading.MetadataReading``): what one command reads once
and keeps, and the fast metadata paths switched off by its one argument.

The commands are run both ways over the whole verify corpus (in process) and through the real
CLI (``CKPTCTL_FAST_METADATA=0`` in the environment): the same findings, inspections, repairs,
files and ``--json`` bytes."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.numpy import save_file

import corpus
from ckptctl import layout as L
from ckptctl.errors import CkptctlError
from ckptctl.format.index import encode_index
from ckptctl.inspect import inspect_path
from ckptctl.fastpaths import FAST_PATHS
from ckptctl.layout.reading import TYPED_FROM, MetadataReading
from ckptctl.resave import resave
from ckptctl.sizes import parse_size
from ckptctl.verify import VerifyOptions, verify_paths
from ckptctl.write.options import ExportOptions
from tests.support import run_cli_subprocess

FAST_ENV = FAST_PATHS["metadata"].env


def _write_index(p: Path, weight_map: dict[str, str]) -> None:
    p.write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": weight_map}), encoding="utf-8")


def test_the_switch_is_the_argument_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAST_ENV, raising=False)
    assert MetadataReading().fast and not MetadataReading(fast=False).fast
    monkeypatch.setenv(FAST_ENV, "0")
    assert not MetadataReading().fast and MetadataReading(fast=True).fast


@pytest.mark.parametrize("fast", [True, False])
def test_an_index_is_parsed_once_per_content_and_each_read_gets_its_own_copy(tmp_path: Path, fast: bool) -> None:
    p = tmp_path / "model.safetensors.index.json"
    _write_index(p, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    reading = MetadataReading(fast=fast)
    first, second = reading.index(p), reading.index(p)
    assert first is not second and first._source is second._source  # one parse, two copies
    first.weight_map["x"] = "elsewhere"
    first.metadata["total_size"] = 0
    assert second.weight_map == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    assert second.metadata == {"total_size": 8}
    # the same size and time stamps, other bytes: read anew, never served from before
    st = os.stat(p)
    _write_index(p, {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"})
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = reading.index(p)
    assert third.weight_map == {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}
    # another reading keeps nothing of this one's
    assert MetadataReading(fast=fast).index(p)._source is not third._source


def test_a_scan_keeps_its_reading_for_the_reads_that_follow(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    save_file({"w": np.ones((2, 2), np.float32)}, str(d / "model-00001-of-00001.safetensors"))
    _write_index(d / "model.safetensors.index.json", {"w": "model-00001-of-00001.safetensors"})
    reading = MetadataReading()
    lay = L.scan(d, reading=reading)
    assert lay.reading is reading
    again = L.scan(d, reading=lay.reading)
    assert again.families[0].index_doc._source is lay.families[0].index_doc._source
    assert L.scan(d).reading is not reading  # a scan without one makes its own


# ---------------------------------------------------------------------------------------------
# the commands both ways


def _tree(d: Path) -> dict[str, str]:
    """What each file below ``d`` holds, with the run's own directory written as P."""
    here = str(d.parent).encode()
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes().replace(here, b"P")).hexdigest()
            if p.is_file() else "other" for p in sorted(d.rglob("*")) if not p.is_symlink()}


def _outcome(fn: Callable[[Path], Any], d: Path) -> Any:
    try:
        out = fn(d)
    except CkptctlError as exc:
        out = {"error": type(exc).__name__, "message": exc.message, "hint": exc.hint}
    text = json.dumps(out, default=str).replace(str(d), "D").replace(str(d.parent), "P")
    # the disk's free space and the time taken, as they are at that moment
    text = re.sub(r'"(space_available|seconds)": [0-9.e-]+', r'"\1": 0', text)
    return json.loads(re.sub(r"[.][0-9a-f]{16}-[0-9a-f]{8}", ".STAGING", text))  # a staging directory's name


def _run(case: corpus.Case, d: Path) -> dict[str, Any]:
    before = _tree(d)
    size = parse_size(case.args[-1]) if "--max-shard-size" in case.args else None
    opts = VerifyOptions(deep=case.deep, max_shard_size=size)
    got = {"verify": _outcome(lambda p: verify_paths([str(p)], options=opts).to_dict(), d),
           "inspect": _outcome(lambda p: inspect_path(p).to_dict(), d)}
    res = _outcome(lambda p: resave(p, ExportOptions(fsync=False), repair=True).to_dict(), d)
    # what the commands changed (a builder's pickle is not byte for byte the same from run to run)
    got["resave"], got["changed"] = res, {k: v for k, v in _tree(d).items() if before.get(k) != v}
    got["removed"] = sorted(before.keys() - _tree(d).keys())
    return got


CASES = list(corpus.CASES) + [corpus.Case("clean_" + k, fn) for k, fn in corpus.CLEAN.items()]


def test_verify_inspect_and_resave_are_the_same_without_the_fast_paths_over_the_corpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    differ = []
    for case in CASES:
        results = []
        for fast in ("1", "0"):
            d = tmp_path / case.name / fast / "ck"  # each run gets the case made afresh (seeded builders)
            d.mkdir(parents=True)
            case.make(d)
            monkeypatch.setenv(FAST_ENV, fast)
            # the corpus's headers are small: the typed decoder is made to read them all
            monkeypatch.setattr("ckptctl.layout.reading.TYPED_FROM", 0 if fast == "1" else TYPED_FROM)
            results.append(_run(case, d))
        if results[0] != results[1]:
            differ.append({"case": case.name, "fast": results[0], "reference": results[1]})
    assert len(CASES) >= 100
    assert differ == [], json.dumps(differ[0], indent=1)[:6000]


def _large(d: Path, *, shards: int = 4, per_shard: int = 1500) -> None:
    """6,000 tensors in 4 shards with their index."""
    d.mkdir()
    wm: dict[str, str] = {}
    total = 0
    for s in range(1, shards + 1):
        name = f"model-{s:05d}-of-{shards:05d}.safetensors"
        names = [f"model.layers.{s}.mlp.experts.{i}.proj.weight" for i in range(per_shard)]
        save_file({n: np.full((2, 2), float(s), np.float32) for n in names}, str(d / name), metadata={"format": "pt"})
        wm.update(dict.fromkeys(names, name))
        total += 16 * per_shard
    (d / "model.safetensors.index.json").write_bytes(encode_index(wm, total))


def _moved(wm: dict[str, str]) -> None:
    wm[next(iter(wm))] = "model-00002-of-00004.safetensors"


def _invented(wm: dict[str, str]) -> None:
    wm["model.not.stored.weight"] = "model-00003-of-00004.safetensors"


@pytest.mark.parametrize("edit", [None, _moved, _invented], ids=["clean", "moved", "invented"])
@pytest.mark.parametrize("command", [("verify", "--json"), ("inspect", "--json"),
                                     ("resave", "--repair", "--dry-run", "--json")])
def test_the_cli_prints_the_same_bytes_without_the_fast_paths(tmp_path: Path, command: tuple[str, ...],
                                                              edit: Callable[[dict[str, str]], None] | None) -> None:
    d = tmp_path / "big"
    _large(d)
    if edit is not None:
        idx = d / "model.safetensors.index.json"
        doc = json.loads(idx.read_text())
        edit(doc["weight_map"])
        idx.write_text(json.dumps(doc, indent=2))
    runs = [run_cli_subprocess(command[0], d, *command[1:], env={**os.environ, FAST_ENV: fast}) for fast in "10"]
    assert runs[0][0] == runs[1][0], (runs[0][2], runs[1][2])
    if command[0] == "resave":  # its time and the disk's free space differ from run to run
        docs = [re.sub(r'"(space_available|seconds)": [0-9.e-]+', "", r[1]) for r in runs]
        assert docs[0] == docs[1]
    else:
        assert runs[0][1] == runs[1][1]
    if edit is not None and command[0] == "verify":
        assert runs[0][0] == 1


def test_the_typed_decoder_takes_over_once_a_reading_has_decoded_typed_from_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below TYPED_FROM bytes of headers the strict reader decodes them (importing msgspec would
    cost more); from the header that reaches it on, the typed decoder; the same headers either way."""
    from ckptctl.format import header_fast

    files = []
    for i in range(3):  # headers of about TYPED_FROM / 2 bytes each
        names = [f"model.layers.{i}.block.{j:05d}." + "x" * 40 for j in range(TYPED_FROM // 2 // 130)]
        files.append(tmp_path / f"s{i}.safetensors")
        save_file({n: np.zeros(1, np.float32) for n in names}, str(files[-1]))
    sizes = [int.from_bytes(f.read_bytes()[:8], "little") for f in files]
    assert sizes[0] + sizes[1] < TYPED_FROM <= sum(sizes)
    typed: list[int] = []
    decode = header_fast.decode
    monkeypatch.setattr(header_fast, "decode", lambda raw, **kw: typed.append(len(raw)) or decode(raw, **kw))
    reading, strict = MetadataReading(fast=True), MetadataReading(fast=False)
    for f in files:
        got, want = reading.header(f), strict.header(f)
        assert got.ok and list(got.tensors.items()) == list(want.tensors.items())
    assert typed == [sizes[2]]
    assert MetadataReading(fast=True).typed(TYPED_FROM) and not MetadataReading(fast=False).typed(TYPED_FROM)


def test_a_command_on_a_small_checkpoint_never_imports_msgspec(tmp_path: Path) -> None:
    """The typed decoder's import is what a small checkpoint would pay for it: it is not made."""
    import subprocess
    import sys

    d = tmp_path / "small"
    d.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), np.float32)}, str(d / "model.safetensors"))
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: sys.stderr.write('MSGSPEC %s\\n' % ('msgspec' in sys.modules)))\n"
             "sys.argv[0] = 'ckptctl'\n"
             "from ckptctl.cli import main\n"
             "main()\n")
    for args in (["verify", str(d), "--static"], ["inspect", str(d), "--json"],
                 ["export", str(d), str(tmp_path / "out")]):
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if not k.startswith("CKPTCTL_")})
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.rstrip().endswith("MSGSPEC False"), (args, proc.stderr)


def test_a_header_read_not_to_be_kept_uses_a_kept_decoding_and_keeps_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``keep=False`` (inspect, an export's source): no copy of the bytes is kept, so each such read
    decodes; a decoding kept by an earlier read (a resave's analysis) is used as any read uses it."""
    import ckptctl.layout.reading as R

    f = tmp_path / "model.safetensors"
    save_file({"a": np.zeros(2, np.float32), "b": np.ones(3, np.float32)}, str(f))
    decoded: list[str] = []
    decode = R.decode_header
    monkeypatch.setattr(R, "decode_header", lambda hdr, raw, **kw: decoded.append(hdr.path) or decode(hdr, raw, **kw))
    reading = MetadataReading()
    first, second = reading.header(f, keep=False), reading.header(f, keep=False)
    assert len(decoded) == 2 and not reading._headers  # nothing kept
    kept = reading.header(f)
    assert len(decoded) == 3
    again = reading.load_header(f, keep=False)
    assert len(decoded) == 3  # the kept decoding, copied
    assert again is not kept and again.tensors is kept.tensors
    assert [list(h.tensors.items()) for h in (first, second, kept)] == [list(again.tensors.items())] * 3


def test_a_kept_header_is_its_bytes_as_read_and_a_change_at_the_same_length_is_decoded_again(
        tmp_path: Path) -> None:
    """A reading keeps the bytes it decoded (not a copy: the decoding leaves them as they are) and
    compares each later read with them: the same bytes give the kept decoding, bytes changed in
    place at the same length are decoded again."""
    f = tmp_path / "model.safetensors"
    save_file({"a": np.zeros(2, np.float32), "b": np.ones(3, np.float32)}, str(f))
    header = f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")]
    reading = MetadataReading()
    first = reading.header(f)
    assert [bytes(seen) for kept in reading._headers.values() for seen, _ in kept] == [header]
    f.write_bytes(f.read_bytes().replace(b'"a"', b'"c"', 1))  # the same length, another name
    second = reading.header(f)
    assert sorted(first.tensors) == ["a", "b"] and sorted(second.tensors) == ["b", "c"]
    assert reading.header(f).tensors is second.tensors  # kept: the same decoding
    assert sorted(bytes(seen) for kept in reading._headers.values() for seen, _ in kept) == \
        sorted([header, header.replace(b'"a"', b'"c"', 1)])
