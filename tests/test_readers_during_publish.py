"""Readers during a publish read one version (issue 33, third round), and resave --output refuses
what export refuses.

The interleaving is held exactly: a real ``ckptctl export --overwrite`` process is stopped at the
fault point ``publish`` (its new version staged and sealed, the rename not made), and the reader
(verify, inspect --json, resave --repair --json, in this process) lets it publish right after it
listed the directory, so every later read of the reader meets the new version. Before the fix,
verify reported the checkpoint broken (the old listing read with the new index), inspect listed
a mix, and resave --repair refused a healthy checkpoint ("tensors are lost").
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ckptctl.errors import CkptctlError, OperationalError
from tests.support import communicate, invoke, popen_ckptctl, run_ckptctl, state, wait_stopped, write_config, \
    write_sharded


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, Path]:
    """Two models of the same shape and different bytes (the writer publishes the second)."""
    for i, seed in ((1, 1), (2, 2)):
        write_sharded(tmp_path / f"src{i}", state(seed, n=6), per_shard=6)
        write_config(tmp_path / f"src{i}")
    return tmp_path / "src1", tmp_path / "src2"


@pytest.fixture
def dst(tmp_path: Path, sources: tuple[Path, Path]) -> Path:
    """The published version: 3 shards of 2 tensors and their index."""
    out = tmp_path / "dst"
    run_ckptctl("export", sources[0], out, "--max-shard-size", "20KB", check=True)
    assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3
    return out


class PublishAfterListing:
    """``os.listdir`` of the destination lets the stopped writer publish (2 shards, another index)
    right after the listing was made; once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, dst: Path, src: Path) -> None:
        self.dst = os.path.realpath(dst)
        self.proc = popen_ckptctl("export", src, dst, "--overwrite", "--max-shard-size", "30KB",
                                  env={"CKPTCTL_STOP_AT": "publish"})
        wait_stopped(self.proc.pid)
        self.real = os.listdir
        self.fired = 0
        monkeypatch.setattr(os, "listdir", self)

    def __call__(self, path: object = ".") -> list[str]:
        names = self.real(path)  # type: ignore[arg-type]
        if not self.fired and isinstance(path, (str, os.PathLike)) and os.path.realpath(path) == self.dst:
            self.fired += 1
            self.proc.send_signal(signal.SIGCONT)
            out, err = communicate(self.proc, 120)
            assert self.proc.returncode == 0, err
        return names

    def published(self) -> None:
        assert self.fired == 1, "the reader never listed the destination"
        assert sorted(n for n in self.real(self.dst) if n.startswith("model-")) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_verify_reads_one_version_while_a_publish_replaces_it(monkeypatch, dst, sources):
    hook = PublishAfterListing(monkeypatch, dst, sources[1])
    r = invoke("verify", dst, "--json")
    hook.published()
    doc = json.loads(r.stdout)
    errors = [f for p in doc["results"] for f in p["findings"] if f["severity"] == "error"]
    assert errors == [] and r.exit_code == 0, (r.exit_code, errors, r.stderr)


def test_inspect_reads_one_version_while_a_publish_replaces_it(monkeypatch, dst, sources):
    hook = PublishAfterListing(monkeypatch, dst, sources[1])
    r = invoke("inspect", dst, "--json")
    hook.published()
    monkeypatch.undo()
    assert r.exit_code == 0, r.stderr
    clean = invoke("inspect", dst, "--json")  # the version now published, read with nothing changing
    assert clean.exit_code == 0
    assert json.loads(r.stdout) == json.loads(clean.stdout)


def test_resave_repair_reads_one_version_while_a_publish_replaces_it(monkeypatch, dst, sources):
    hook = PublishAfterListing(monkeypatch, dst, sources[1])
    r = invoke("resave", dst, "--repair", "--json")
    hook.published()
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["ok"] and doc["unchanged"], (r.exit_code, doc, r.stderr)


def test_a_shard_gone_before_the_keep_layout_plan_is_one_line_not_a_traceback(monkeypatch, dst):
    """The keep-layout plan reads each kept shard's header bytes: a shard removed after the
    analysis (a writer that published meanwhile) is an error of one line and a JSON document."""
    index = dst / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["total_size"] += 1  # a repair that rewrites the index only
    index.write_text(json.dumps(doc, indent=2))
    import ckptctl.resave as R

    real = R.keep_layout_plan

    def gone(kf):  # type: ignore[no-untyped-def]
        os.unlink(dst / "model-00002-of-00003.safetensors")
        return real(kf)

    monkeypatch.setattr(R, "keep_layout_plan", gone)
    r = invoke("resave", dst, "--repair", "--json")
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    out = json.loads(r.stdout)
    assert r.exit_code == 3 and not out["ok"], (r.exit_code, out)
    assert "model-00002-of-00003.safetensors" in out["error"]["message"]


# ---- resave --output: the destinations export refuses -----------------------------------------

@pytest.mark.parametrize("where", ["inside", "parent", "same"])
def test_resave_output_refuses_what_export_refuses(dst, where):
    out = {"inside": dst / "sub", "parent": dst.parent, "same": dst}[where]
    before = sorted(p.name for p in dst.parent.iterdir())
    r = invoke("resave", dst, "--output", out, "--overwrite", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["error"]["code"] == "usage", (r.exit_code, doc)
    e = invoke("export", dst, out, "--overwrite", "--json")
    assert e.exit_code == 2 and json.loads(e.stdout)["error"]["code"] == "usage"  # export refuses it the same way
    assert sorted(p.name for p in dst.parent.iterdir()) == before
    assert not (dst / "sub").exists()


# ---- the mechanism --------------------------------------------------------------------------------

def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


def test_one_version_reads_again_when_the_directory_was_replaced(tmp_path):
    from ckptctl.layout.version import ATTEMPTS, Held, one_version

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "v").write_text("1")
    (b / "v").write_text("2")
    seen = []

    def read(attempt: int) -> str:
        text = (a / "v").read_text()
        seen.append(text)
        if attempt == 0:
            _swap(a, b)  # a publish while it is read
        return text

    assert one_version(a, read) == "2" and seen == ["1", "2"]


def test_one_version_raises_the_readers_error_only_when_the_version_held(tmp_path):
    from ckptctl.layout.version import ATTEMPTS, Held, one_version

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()

    def broken(attempt: int) -> None:
        if attempt == 0:
            _swap(a, b)
            raise OSError(2, "gone")  # straddled a publish: read again
        raise OperationalError("a real failure")

    with pytest.raises(OperationalError, match="a real failure"):
        one_version(a, broken)


def test_one_version_gives_up_with_one_line_when_every_read_is_superseded(tmp_path):
    from ckptctl.layout.version import ATTEMPTS, Held, one_version

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    calls = []

    def always(attempt: int) -> None:
        calls.append(attempt)
        _swap(a, b)

    with pytest.raises(CkptctlError, match="replaced") as exc:
        one_version(a, always)
    assert exc.value.exit_code == 3 and calls == list(range(ATTEMPTS))


def test_one_version_reads_a_file_once_and_closes_what_it_held(tmp_path):
    from ckptctl.layout.version import ATTEMPTS, Held, one_version

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    assert one_version(f, lambda attempt: attempt) == 0
    held = Held.open(tmp_path)
    assert held is not None and held.current()
    fd = held.fd
    one_version(tmp_path, lambda attempt: None, held=held)
    with pytest.raises(OSError):
        os.fstat(fd)


# ---- the same interleaving in real processes (the reader's own fault point) ---------------------

@pytest.mark.parametrize("argv", [["verify", "--json"], ["inspect", "--json"], ["resave", "--repair", "--json"]],
                         ids=["verify", "inspect", "resave"])
def test_a_reader_process_stopped_after_its_listing_reads_one_version(dst, sources, argv):
    """The reader stops itself at ``read-listed`` (its listing made, nothing else read); a whole
    publish runs; the reader goes on. Each later stop (a read made again) is let go at once."""
    from tests.support import process_state

    reader = popen_ckptctl(argv[0], dst, *argv[1:], env={"CKPTCTL_STOP_AT": "read-listed"})
    wait_stopped(reader.pid)
    run_ckptctl("export", sources[1], dst, "--overwrite", "--max-shard-size", "30KB", check=True)
    stops = 0
    while reader.poll() is None:
        if process_state(reader.pid) == "T":
            stops += 1
            reader.send_signal(signal.SIGCONT)
        time.sleep(0.005)
    out, err = communicate(reader, 120)
    doc = json.loads(out)
    assert reader.returncode == 0 and doc["ok"] and "Traceback" not in err, (reader.returncode, doc, err)
    assert stops >= 1  # it read again, on the version now published
    if argv[0] == "verify":
        assert [f for r in doc["results"] for f in r["findings"] if f["severity"] == "error"] == []
    if argv[0] == "resave":
        assert doc["unchanged"]
    if argv[0] == "inspect":  # what a clean inspect of the version now published says, byte for byte
        assert out == run_ckptctl("inspect", dst, "--json", check=True).stdout
