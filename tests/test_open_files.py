"""The writer's pool of open source files (``sources.base.OpenFiles``), on real files: each file
opened once while the pool holds them all, the least recently used closed first when it does not,
each file's block size known from its open, and the check after a shard: one ``stat`` per path,
also for a path both opened and listed by a source, and a refusal ("changed while reading",
exit 3) for a file a source listed that was replaced, opened or not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptctl.errors import OperationalError
from ckptctl.sources.base import FileId, OpenFiles


def _files(d: Path, n: int) -> list[str]:
    paths = []
    for i in range(n):
        p = d / f"f{i}.bin"
        p.write_bytes(bytes([i]) * 4096)
        paths.append(str(p))
    return paths


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    calls: list[str] = []
    real = getattr(os, name)

    def counted(path, *args, **kwargs):
        calls.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, counted)
    return calls


@pytest.fixture
def pool_of():
    """``pool_of(limit)``: an :class:`OpenFiles` pool, closed after the test."""
    made: list[OpenFiles] = []

    def make(limit: int | None = None) -> OpenFiles:
        made.append(OpenFiles(limit=limit))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


def test_a_pool_that_holds_every_file_opens_each_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      pool_of) -> None:
    paths = _files(tmp_path, 10)
    pool = pool_of(10)
    opened = _counting(monkeypatch, "open")
    for _ in range(5):
        for p in paths[::-1] + paths:
            f = pool.file(p)
            assert os.pread(f.fd, 1, 0) == bytes([paths.index(p)])
            assert pool.fd(p) == f.fd
    assert sorted(opened) == sorted(paths)


def test_the_least_recently_used_file_is_closed_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      pool_of) -> None:
    a, b, c = _files(tmp_path, 3)
    pool = pool_of(2)
    opened = _counting(monkeypatch, "open")
    fd_a = pool.fd(a)
    pool.fd(b)
    assert pool.fd(a) == fd_a  # a is now the most recently used
    pool.fd(c)  # closes b, not a
    assert pool.fd(a) == fd_a and os.pread(fd_a, 1, 0) == b"\x00"
    pool.fd(b)
    assert opened == [a, b, c, b]


def test_a_file_knows_its_filesystems_block_size(tmp_path: Path, pool_of) -> None:
    (p,) = _files(tmp_path, 1)
    f = pool_of().file(p)
    assert f.block == os.statvfs(p).f_bsize and f.ident == FileId.of(os.stat(p))


def test_the_check_stats_each_path_once_also_one_a_source_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   pool_of) -> None:
    paths = _files(tmp_path, 4)
    pool = pool_of()
    for p in paths[:3]:
        pool.fd(p)
    listed = {p: FileId.of(os.stat(p)) for p in paths}  # a source's pins: all four
    stats = _counting(monkeypatch, "stat")
    pool.check(listed)
    assert sorted(stats) == sorted(paths)


@pytest.mark.parametrize("opened", [True, False])
def test_the_check_refuses_a_listed_file_replaced_opened_or_not(tmp_path: Path, opened: bool, pool_of) -> None:
    a, b = _files(tmp_path, 2)
    listed = {a: FileId.of(os.stat(a)), b: FileId.of(os.stat(b))}
    pool = pool_of()
    pool.file(a, listed.get)
    if opened:
        pool.file(b, listed.get)
    pool.check(listed)  # nothing changed yet
    tmp = tmp_path / "next"
    tmp.write_bytes(b"\x07" * 4096)
    os.replace(tmp, b)  # a trainer's save by rename
    with pytest.raises(OperationalError, match="changed while reading"):
        pool.check(listed)


def test_two_versions_listed_for_one_path_are_refused(tmp_path: Path, pool_of) -> None:
    (a,) = _files(tmp_path, 1)
    pool = pool_of()
    now = pool.file(a).ident
    with pytest.raises(OperationalError, match="changed while reading"):
        pool.check({a: now._replace(mtime_ns=now.mtime_ns - 1)})


def test_a_file_opened_as_another_version_than_listed_is_refused(tmp_path: Path, pool_of) -> None:
    (a,) = _files(tmp_path, 1)
    listed = FileId.of(os.stat(a))
    Path(a).write_bytes(b"\x09" * 8192)  # rewritten in place after the listing read it
    with pytest.raises(OperationalError, match="changed while reading"):
        pool_of().file(a, {a: listed}.get)
